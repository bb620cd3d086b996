from _typeshed import ReadableBuffer, WriteableBuffer

def chunk_sums(
    address: int, nbytes: int, keys: ReadableBuffer, out: WriteableBuffer, /
) -> None: ...
