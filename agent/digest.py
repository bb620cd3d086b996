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
BLOCK_BYTES = 4 << 20  # processed this much at a time (bounded temporaries, cache-sized)
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
    flat = (
        data.reshape(-1).view(torch.uint8) if data.numel() else data.new_empty(0).view(torch.uint8)
    )
    keys = _keys(flat.device)
    chunk_bytes = CHUNK * 4
    whole = flat.numel() - flat.numel() % chunk_bytes
    rows_per_block = max(BLOCK_BYTES // chunk_bytes, 1)
    parts = []
    if whole:
        words = flat[:whole].view(torch.int32).reshape(-1, CHUNK)
        for start in range(0, words.shape[0], rows_per_block):
            block = words[start : start + rows_per_block]
            # int32 * int64 -> int64: the widening and the multiply in one pass.
            parts.append(torch.stack([(block * k).sum(dim=1) for k in keys], dim=1))
    if whole < flat.numel():
        tail = torch.zeros(chunk_bytes, dtype=torch.uint8, device=flat.device)
        tail[: flat.numel() - whole] = flat[whole:]
        words = tail.view(torch.int32).reshape(1, CHUNK)
        parts.append(torch.stack([(words * k).sum(dim=1) for k in keys], dim=1))
    if not parts:
        return torch.zeros((0, LANES), dtype=torch.int64, device=flat.device)
    return torch.cat(parts)


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
