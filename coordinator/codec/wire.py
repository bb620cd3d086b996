"""Agent-safe proto <-> contract conversion: manifests, layouts, protocol version, states.

Every field from the network is validated here first. Imports only the contract and the
generated stubs: `import cohortgate.agent.client` loads nothing of the decision, state or service.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
)
from cohortgate.coordinator.contract.layout import (
    AXES,
    WIDTHS,
    Layout,
    PieceColumns,
    ShardPiece,
    le_array,
)
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.contract.manifest import (
    MANIFEST_FORMAT_VERSION,
    Entry,
    Kind,
    Manifest,
    ManifestError,
)

PROTOCOL_VERSION = 1
DEFAULT_LIMITS = Limits()

MAX_JOB_ID = 256
MAX_TEXT = 512
MAX_NAME = 1024
MAX_DIMS = 64
# A SHA-256: a signature, a weights digest.
SHA256_BYTES = 32

_KIND_TO_PB = {
    Kind.PARAMETER: pb.ManifestEntry.KIND_PARAMETER,
    Kind.BUFFER: pb.ManifestEntry.KIND_BUFFER,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


def text(value: str, field: str, limit: int = MAX_TEXT, *, required: bool = False) -> str:
    if required and not value:
        raise InvalidArgument(f"{field} is empty; it is required")
    if len(value) > limit:
        raise InvalidArgument(f"{field} is {len(value)} characters long; the limit is {limit}")
    if not value.isprintable():
        raise InvalidArgument(f"{field} {value[:40]!r} holds non-printable characters")
    return value


def sha256(value: bytes, field: str, *, optional: bool = False) -> bytes:
    """A 32-byte SHA-256 (a signature, a weights digest); b"" allowed where `optional`."""
    if (value or not optional) and len(value) != SHA256_BYTES:
        raise InvalidArgument(
            f"{field} is {len(value)} bytes; a SHA-256 is {SHA256_BYTES} bytes"
            + (" (or empty when not sent)" if optional else "")
        )
    return bytes(value)


# -- layouts --------------------------------------------------------------------------
MAX_PIECES = 100_000


def _dims(values: Sequence[int], what: str) -> tuple[int, ...]:
    if len(values) > MAX_DIMS:
        raise LimitExceeded(f"{what} has {len(values)} dimensions; the limit is {MAX_DIMS}")
    return tuple(values)


def layout_from_pb(msg: pb.Layout, limits: Limits = DEFAULT_LIMITS) -> Layout:
    for name, table in (("sizes", msg.sizes), ("position", msg.position)):
        unknown = sorted(set(table) - set(AXES))
        if unknown:
            raise InvalidArgument(
                f"layout {name} names unknown axes {unknown[:5]}; use {', '.join(AXES)}"
            )
    if any(v == 0 or v > limits.max_world_size for v in msg.sizes.values()):
        raise InvalidArgument(
            f"layout sizes {dict(msg.sizes)} must each be between 1 and {limits.max_world_size}"
        )
    if msg.pieces and msg.HasField("columns"):
        raise InvalidArgument("the layout sends both pieces and columns; send one of them")
    pieces = _columns(msg.columns) if msg.HasField("columns") else _pieces(msg.pieces)
    return Layout(
        sizes={a: int(msg.sizes.get(a, 1)) for a in AXES},
        position={a: int(msg.position.get(a, 0)) for a in AXES},
        config=text(msg.config, "layout config"),
        dtype=text(msg.dtype, "layout dtype"),
        quantization=text(msg.quantization, "layout quantization"),
        pieces=pieces,
        format=msg.format,
    )


def _too_many(count: int) -> LimitExceeded:
    return LimitExceeded(f"the layout declares {count} pieces; the limit is {MAX_PIECES} per rank")


def _pieces(msgs: Sequence[pb.ShardPiece]) -> PieceColumns:
    """Pieces as one message each (older agents), checked and turned into columns."""
    if len(msgs) > MAX_PIECES:
        raise _too_many(len(msgs))
    pieces = []
    for i, p in enumerate(msgs):
        what = f"layout piece {i} ('{p.tensor[:80]}')"
        text(p.tensor, f"{what} tensor", MAX_NAME, required=True)
        shape = _dims(p.shape, what)
        offset, length = _dims(p.offset, what), _dims(p.length, what)
        if any(v < 0 or v > MAX_EXTENT for v in (*shape, *offset, *length)):
            raise InvalidArgument(
                f"{what} has a negative or oversized shape, offset or length "
                f"({list(shape)}, {list(offset)}, {list(length)}); each is 0 to 2^62"
            )
        pieces.append(ShardPiece(p.tensor, shape, offset, length, p.replicated))
    try:
        return PieceColumns.of(pieces)
    except ValueError as exc:
        raise InvalidArgument(f"layout pieces: {exc}") from exc


# Shapes, offsets and lengths are at most 2^62 - 1: an offset plus a length stays an int64.
MAX_EXTENT = 2**62 - 1
# The top bytes of little-endian integers from 0 to MAX_EXTENT, by width: an int64's is
# 0 to 0x3f, a non-negative int32's 0 to 0x7f.
_HIGH_BYTES = {8: bytes(range(0x40)), 4: bytes(range(0x80))}


def _in_extent(data: bytes, width: int) -> bool:
    """Every little-endian integer of `width` bytes in `data` is between 0 and MAX_EXTENT,
    judged by its top byte alone (at C speed, with no integer objects: a million pieces in
    ~1 ms)."""
    return not data[width - 1 :: width].translate(None, _HIGH_BYTES[width])


def _columns(msg: pb.PieceColumns) -> PieceColumns:
    """Pieces as columns (what agents send), checked without a Python object per piece."""
    tensors = tuple(msg.tensors)
    if len(tensors) > MAX_PIECES:
        raise _too_many(len(tensors))
    if len(set(tensors)) != len(tensors):
        raise InvalidArgument("layout columns name a tensor twice; group its pieces in one run")
    sizes = list(map(len, tensors))
    printable = "".join(tensors).isprintable()
    if tensors and (min(sizes) == 0 or max(sizes) > MAX_NAME or not printable):
        for i, name in enumerate(tensors):  # one C pass above; the loop only to name it
            text(name, f"layout tensor {i}", MAX_NAME, required=True)
    dims, counts_bytes = msg.dims, msg.counts
    if len(dims) != len(tensors) or len(counts_bytes) != 4 * len(tensors):
        raise InvalidArgument(
            f"layout columns: {len(tensors)} tensors need {len(tensors)} bytes of dims and "
            f"{4 * len(tensors)} of counts; got {len(dims)} and {len(counts_bytes)}"
        )
    if dims and max(dims) > MAX_DIMS:
        raise LimitExceeded(f"a layout tensor has {max(dims)} dimensions; the limit is {MAX_DIMS}")
    counts = le_array("I", counts_bytes)
    total = sum(counts)
    if total > MAX_PIECES:
        raise _too_many(total)
    width = msg.width or 8
    if width not in WIDTHS:
        raise InvalidArgument(f"layout columns: width is {width}; values are 4 or 8 bytes")
    values = sum(d * c for d, c in zip(dims, counts, strict=True))
    _column_sizes(msg, width, len(tensors), total, values)
    return PieceColumns(
        tensors,
        bytes(dims),
        bytes(msg.shapes),
        bytes(counts_bytes),
        bytes(msg.offsets),
        bytes(msg.lengths),
        bytes(msg.replicated),
        width,
    )


def _column_sizes(msg: pb.PieceColumns, width: int, tensors: int, pieces: int, values: int) -> None:
    """Each column as long as the counts say, and every value in range."""
    for field, data, want in (
        ("shapes", msg.shapes, width * sum(msg.dims)),
        ("offsets", msg.offsets, width * values),
        ("lengths", msg.lengths, width * values),
        ("replicated", msg.replicated, pieces),
    ):
        if len(data) != want:
            raise InvalidArgument(
                f"layout columns: {field} is {len(data)} bytes; {pieces} pieces of "
                f"{tensors} tensors need {want}"
            )
        if field != "replicated" and not _in_extent(data, width):
            raise InvalidArgument(
                f"layout columns: {field} holds a value outside 0 to 2^62; shapes, offsets "
                "and lengths are non-negative"
            )
    if msg.replicated.translate(None, b"\x00\x01"):
        raise InvalidArgument("layout columns: replicated holds a byte other than 0 or 1")


def layout_to_pb(lay: Layout) -> pb.Layout:
    cols = lay.columns()
    msg = pb.Layout(
        format=lay.format,
        sizes=lay.sizes,
        position=lay.position,
        config=lay.config,
        dtype=lay.dtype,
        quantization=lay.quantization,
    )
    if len(cols) or cols.tensors:
        msg.columns.CopyFrom(
            pb.PieceColumns(
                tensors=cols.tensors,
                dims=cols.dims,
                shapes=cols.shapes,
                counts=cols.counts,
                offsets=cols.offsets,
                lengths=cols.lengths,
                replicated=cols.replicated,
                width=cols.width,
            )
        )
    return msg


# -- manifests ------------------------------------------------------------------------
def entry_to_pb(entry: Entry) -> pb.ManifestEntry:
    msg = pb.ManifestEntry(
        kind=_KIND_TO_PB[entry.kind],
        name=entry.name,
        dtype=entry.dtype,
        shape=entry.shape,
        requires_grad=entry.requires_grad,
    )
    if entry.alias_of is not None:
        msg.alias_of = entry.alias_of
    if entry.strides is not None:
        msg.strides.values.extend(entry.strides)
    return msg


def manifest_to_pb(manifest: Manifest) -> pb.Manifest:
    return pb.Manifest(
        format=MANIFEST_FORMAT_VERSION, entries=[entry_to_pb(e) for e in manifest.entries]
    )


def entry_from_pb(msg: pb.ManifestEntry, position: int) -> Entry:
    kind = _KIND_FROM_PB.get(msg.kind)
    if kind is None:
        raise InvalidArgument(f"manifest entry {position} has no kind (parameter or buffer)")
    if len(msg.name) > MAX_NAME:
        raise LimitExceeded(
            f"manifest entry {position} has a name of {len(msg.name)} characters; "
            f"the limit is {MAX_NAME}"
        )
    if len(msg.shape) > MAX_DIMS or len(msg.strides.values) > MAX_DIMS:
        raise LimitExceeded(
            f"manifest entry {position} ('{msg.name[:80]}') has more than {MAX_DIMS} dimensions"
        )
    return Entry(
        kind,
        msg.name,
        msg.dtype,
        tuple(msg.shape),
        msg.requires_grad,
        msg.alias_of if msg.HasField("alias_of") else None,
        tuple(msg.strides.values) if msg.HasField("strides") else None,
    )


def manifest_from_pb(msg: pb.Manifest, limits: Limits = DEFAULT_LIMITS) -> Manifest:
    if msg.format != MANIFEST_FORMAT_VERSION:
        raise FailedPrecondition(
            f"manifest format {msg.format} is not the format this coordinator reads "
            f"({MANIFEST_FORMAT_VERSION}); upgrade the older of agent and coordinator"
        )
    if len(msg.entries) > limits.max_manifest_entries:
        raise LimitExceeded(
            f"manifest has {len(msg.entries)} entries; the limit is "
            f"max_manifest_entries={limits.max_manifest_entries}"
        )
    try:
        return Manifest.of(entry_from_pb(e, i) for i, e in enumerate(msg.entries))
    except ManifestError as exc:
        raise InvalidArgument(f"invalid manifest: {exc}") from exc


# -- cohort states ---------------------------------------------------------------------------
STATE_TO_PB = {
    "waiting": pb.COHORT_STATE_WAITING,
    "formed": pb.COHORT_STATE_FORMED,
    "refused": pb.COHORT_STATE_REFUSED,
    "expired": pb.COHORT_STATE_EXPIRED,
    "abandoned": pb.COHORT_STATE_ABANDONED,
}
STATE_NAMES = {v: k for k, v in STATE_TO_PB.items()}


# -- answering asks -------------------------------------------------------------------
def manifest_answer(
    join: pb.JoinRequest, round_: int, manifest: Manifest
) -> pb.UploadManifestRequest:
    """The upload that answers a manifest request (in round `round_`) for the rank that
    joined with `join`: its manifest, under the signature it joined with."""
    return pb.UploadManifestRequest(
        job_id=join.job_id,
        round=round_,
        rank=join.rank,
        incarnation=join.incarnation,
        signature=join.signature,
        manifest=manifest_to_pb(manifest),
    )


def digests_answer(
    join: pb.JoinRequest, round_: int, digests: Sequence[bytes]
) -> pb.UploadDigestsRequest:
    """The upload that answers a digest request: one digest per manifest entry, in order."""
    return pb.UploadDigestsRequest(
        job_id=join.job_id,
        round=round_,
        rank=join.rank,
        incarnation=join.incarnation,
        digests=list(digests),
    )


# The first chunk holds the request's front fields (job, round, rank, incarnation and
# signature: < 1 KiB) and little else, so a refusal costs the sender one small message.
FIRST_CHUNK_BYTES = 16 * 1024
# Under the smallest --max-message-bytes a coordinator takes (512 KiB).
CHUNK_BYTES = 256 * 1024


def upload_chunks(
    request: pb.UploadManifestRequest | pb.UploadDigestsRequest, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.UploadChunk]:
    """An upload as UploadManifestChunks / UploadDigestsChunks sends it: the serialized
    request in order, the first chunk small and declaring the whole size."""
    data = request.SerializeToString()
    yield pb.UploadChunk(data=data[:FIRST_CHUNK_BYTES], total_bytes=len(data))
    view = memoryview(data)
    for start in range(FIRST_CHUNK_BYTES, len(data), chunk_bytes):
        yield pb.UploadChunk(data=bytes(view[start : start + chunk_bytes]))
