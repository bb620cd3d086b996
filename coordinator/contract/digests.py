"""Weight digests on the coordinator's side (torch-free): how per-tensor digests combine into
a rank's, and which tensors two ranks' digests say differ. agent/digest.py computes them."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

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


def differing(
    names: Sequence[str], reference: Sequence[bytes], other: Sequence[bytes]
) -> list[str]:
    """Names of the tensors whose digests differ, in manifest order."""
    return [n for n, a, b in zip(names, reference, other, strict=True) if a != b]
