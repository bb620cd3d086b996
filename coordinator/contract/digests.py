"""Weight digests on the coordinator's side (torch-free): how per-tensor digests combine into
a rank's, and which tensors two ranks' digests say differ. agent/digest.py computes them."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

from cohortgate.coordinator.contract.errors import InvalidArgument

FORMAT = b"cohortgate.digest.v2"
DIGEST_FORMAT_VERSION = 2
DIGEST_BYTES = 32


def combine(digests: Iterable[tuple[str, bytes]]) -> bytes:
    """The rank's digest: SHA-256 over (name, digest) in manifest order."""
    h = hashlib.sha256(FORMAT + b"\0rank")
    for name, digest in digests:
        encoded = name.encode()
        h.update(struct.pack("<I", len(encoded)) + encoded + digest)
    return h.digest()


def combine_uploaded(names: Iterable[str], digests: Sequence[bytes]) -> bytes:
    """An upload's per-tensor digests combined under the manifest's names (O(entries): the
    coordinator runs it off its event loop for large uploads); a digest of the wrong size is
    INVALID_ARGUMENT."""
    bad = next((i for i, d in enumerate(digests) if len(d) != DIGEST_BYTES), None)
    if bad is not None:
        raise InvalidArgument(
            f"digests[{bad}] is {len(digests[bad])} bytes; each digest is {DIGEST_BYTES}"
        )
    return combine(zip(names, digests, strict=True))


def differing(
    names: Sequence[str], reference: Sequence[bytes], other: Sequence[bytes]
) -> list[str]:
    """Names of the tensors whose digests differ, in manifest order."""
    return [n for n, a, b in zip(names, reference, other, strict=True) if a != b]


FILES_FORMAT = b"cohortgate.files.v1"
MAX_FILES = 2000  # local code files one rank names (UploadFiles)
MAX_FILE_PATH = 200


def files_field(files: Iterable[tuple[str, bytes]]) -> str:
    """The `code` fingerprint's `modules` field: how many local code files, and a SHA-256
    over their paths and digests in path order ("12 files sha256:<16 hex>"). The agent
    computes it at join; the coordinator checks an UploadFiles answer against it."""
    h = hashlib.sha256(FILES_FORMAT)
    n = 0
    for path, digest in sorted(files):
        data = path.encode()
        h.update(len(data).to_bytes(4, "big") + data + digest)
        n += 1
    return f"{n} file{'' if n == 1 else 's'} sha256:{h.hexdigest()[:16]}"
