"""Content digests of a model's tensors, computed where the tensors live.

The algorithm (format `cohortgate.digest.v1`), the same on every device:

- A tensor's bytes (its contiguous form; any dtype: bfloat16, float8, bool, ints) are read
  as little-endian signed 32-bit words, the tail zero-padded to whole chunks of CHUNK words.
- Each chunk is reduced to two 64-bit sums, one per lane: sum(word[i] * key[lane][i]) with
  wrapping 64-bit arithmetic. The keys are fixed pseudo-random 64-bit values derived from
  SHA-256 (so they are the same on every machine and torch version).
- The chunk sums (16 bytes per 16 KiB of tensor) are the only thing copied to the host;
  SHA-256 over a header (name, dtype, shape, byte length) and the sums gives the tensor's
  digest, and SHA-256 over every (name, digest) in manifest order gives the rank's.

Collision probability: for two different byte strings of one tensor, a chunk whose words
differ (a nonzero difference d, |d| < 2^32) keeps a zero lane sum with probability at most
2^-33 over the keys, so both lanes with at most 2^-66; the keys are fixed, so this is a
statement about non-adversarial differences (a missed seed, a stale checkpoint), not about
an attacker crafting weights. After the sums, SHA-256 (2^-128).

Speed: two fused multiply-and-widen plus reduce passes per block of BLOCK_BYTES, on the
tensor's own device; no copy of the weights leaves the device.
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING, Any

from coordinator.digests import FORMAT, combine
from coordinator.manifest import ManifestError

__all__ = ["FORMAT", "chunk_sums", "combine", "tensor_digest", "weight_digests"]

if TYPE_CHECKING:
    import torch

CHUNK = 4096  # words per chunk: 16 KiB of tensor per 16 bytes of sums
BLOCK_BYTES = 2 << 20  # of tensor per step: bounded, cache-sized temporaries
LANES = 2

_KEYS: dict[Any, Any] = {}


def _keys(device: Any) -> torch.Tensor:
    """(LANES, CHUNK) int64 keys on `device`, from SHA-256 in counter mode."""
    import torch

    cached = _KEYS.get(device)
    if cached is None:
        stream = b"".join(
            hashlib.sha256(FORMAT + struct.pack("<I", i)).digest()
            for i in range(LANES * CHUNK * 8 // 32)
        )
        keys = torch.frombuffer(bytearray(stream), dtype=torch.int64).reshape(LANES, CHUNK)
        cached = _KEYS[device] = keys.to(device)
    return cached


def chunk_sums(tensor: torch.Tensor) -> torch.Tensor:
    """(chunks, LANES) int64 sums of `tensor`'s bytes, computed on its device."""
    import torch

    data = tensor.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    flat = data.reshape(-1).view(torch.uint8)
    keys = _keys(flat.device)
    chunk_bytes = CHUNK * 4
    whole = flat.numel() - flat.numel() % chunk_bytes
    rows = whole // chunk_bytes
    out = torch.empty((rows + (whole < flat.numel()), LANES), dtype=torch.int64, device=flat.device)
    if rows:
        words = flat[:whole].view(torch.int32).reshape(rows, CHUNK)
        step = max(BLOCK_BYTES // chunk_bytes, 1)
        # Preallocated, cache-sized buffers: the words sign-extended to int64 once (an
        # int32 * int64 product would convert inside the multiply, 4x slower on CPU), then
        # one multiply and one row sum per lane, all in place.
        wide = torch.empty((min(step, rows), CHUNK), dtype=torch.int64, device=flat.device)
        product = torch.empty_like(wide)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            w, p = wide[:n], product[:n]
            w.copy_(words[start : start + n])
            for lane in range(LANES):
                torch.mul(w, keys[lane], out=p)
                torch.sum(p, dim=1, out=out[start : start + n, lane])
    if whole < flat.numel():
        tail = torch.zeros(chunk_bytes, dtype=torch.uint8, device=flat.device)
        tail[: flat.numel() - whole] = flat[whole:]
        w = tail.view(torch.int32).to(torch.int64)
        for lane in range(LANES):
            out[rows, lane] = (w * keys[lane]).sum()
    return out


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    sums = chunk_sums(tensor).cpu().contiguous()  # 1/1024 of the tensor's size
    h = hashlib.sha256(FORMAT)
    header = f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{tuple(tensor.shape)}\0"
    h.update(header.encode())
    h.update(struct.pack("<Q", tensor.numel() * tensor.element_size()))
    h.update(sums.numpy().astype("<i8", copy=False).tobytes())
    return h.digest()


def weight_digests(module: torch.nn.Module) -> list[tuple[str, bytes]]:
    """(name, digest) of every parameter and buffer in manifest order (aliases of a tied
    tensor digest like the tensor they alias)."""
    from agent.signature import walk

    out = []
    for name, tensor in walk(module):
        if tensor.is_meta:
            raise ManifestError(
                f"cannot digest '{name}': it is a meta tensor (no values yet); materialise "
                "the weights before joining with verify_values=True"
            )
        out.append((name, tensor_digest(name, tensor)))
    return out
