"""Weight digests on the coordinator's side (torch-free): how per-tensor digests combine into
a rank's, and which tensors two ranks' digests say differ. agent/digest.py computes them."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

from coordinator.contract.errors import InvalidArgument

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
