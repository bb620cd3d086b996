"""Content digests of a model's tensors, computed where the tensors live.

The algorithm (format `cohortgate.digest.v2`), the same on every device:

- A tensor's bytes (its contiguous form; any dtype: bfloat16, float8, bool, ints) are read
  as little-endian unsigned 32-bit words, the tail zero-padded to whole chunks of CHUNK words.
- Each chunk is reduced to two 64-bit sums, one per lane: sum(word[i] * key[lane][i]) mod
  2^64, every product exact (32 x 32 bits). The keys are fixed pseudo-random 32-bit values
  derived from SHA-256, so they are the same on every machine and torch version.
- The chunk sums (16 bytes per 16 KiB of tensor) are the only thing copied to the host;
  SHA-256 over a header (name, dtype, shape, byte length) and the sums gives the tensor's
  digest, and SHA-256 over every (name, digest) in manifest order gives the rank's.

Collision probability: take two different byte strings of one tensor and a chunk whose
words differ, d[j] != 0 for some j, |d[j]| < 2^32. Whatever the other keys, the map
key -> key * d[j] mod 2^64 is one-to-one on 32-bit keys (|(k - k') * d[j]| < 2^64), so at
most one of the 2^32 values of key[lane][j] gives a zero lane difference: at most 2^-32 per
lane, 2^-64 for both (independent keys). The keys are fixed, so this is a statement about
non-adversarial differences (a missed seed, a stale checkpoint), not about an attacker
crafting weights. After the sums, SHA-256 (2^-128).

Where it runs: on the CPU, a fused C kernel (agent/_digest.c, built with the package; one
pass over the bytes, split across torch's intra-op threads); on other devices, and on a
CPU where the kernel was not built, the same sums from torch ops on the tensor's own
device, in cache-sized blocks. No copy of the weights leaves their device.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import TYPE_CHECKING, Any

from cohortgate.coordinator.contract.digests import FORMAT, combine
from cohortgate.coordinator.contract.manifest import ManifestError

__all__ = [
    "FORMAT",
    "KERNEL",
    "chunk_sums",
    "combine",
    "tensor_digest",
    "tensor_digests",
    "weight_digests",
]

if TYPE_CHECKING:
    import torch

CHUNK = 4096  # words per chunk: 16 KiB of tensor per 16 bytes of sums
CHUNK_BYTES = 4 * CHUNK
# Of tensor per step of the torch ops, bounding their temporaries (4x the block): on the CPU
# cache-sized; on a GPU larger, since each step is 6 kernel launches (~5 us each) and 2 MiB
# takes well under a microsecond of HBM bandwidth (an estimate: not yet measured on a GPU).
BLOCK_BYTES = 2 << 20
DEVICE_BLOCK_BYTES = 16 << 20
LANES = 2
# Below this a tensor is not split across threads (the hand-off would cost more).
PARALLEL_BYTES = 4 << 20

_kernel: ModuleType | None
try:  # the fused CPU kernel; absent where the package was installed without a C compiler
    from cohortgate.agent import _digest as _kernel
except ImportError:  # pragma: no cover - depends on the install
    _kernel = None

KERNEL: bool = _kernel is not None
"""Whether CPU tensors are digested by the fused C kernel (else by torch ops, ~5x slower)."""

_KEYS: dict[Any, torch.Tensor] = {}  # per device
_POOL: list[tuple[int, ThreadPoolExecutor]] = []
_WARNED: list[bool] = []  # the slow-path warning, once per process


@functools.cache
def _key_bytes() -> bytes:
    """LANES * CHUNK little-endian uint32 keys, from SHA-256 in counter mode."""
    return b"".join(
        hashlib.sha256(FORMAT + struct.pack("<I", i)).digest()
        for i in range(LANES * CHUNK * 4 // 32)
    )


def _keys(device: Any) -> torch.Tensor:
    """(LANES, CHUNK) int64 keys (each below 2^32) on `device`."""
    import torch

    cached = _KEYS.get(device)
    if cached is None:
        words = torch.frombuffer(bytearray(_key_bytes()), dtype=torch.int32)
        keys = (words.to(torch.int64) & 0xFFFFFFFF).reshape(LANES, CHUNK)
        cached = _KEYS[device] = keys.to(device)
    return cached


def _threads(nbytes: int) -> int:
    import torch

    return max(1, min(torch.get_num_threads(), nbytes // PARALLEL_BYTES))


def _pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least `workers` threads (replaced by a bigger one when
    torch's thread count grows; the old one is not shut down, since another thread may be
    submitting to it: its idle threads exit once it is no longer referenced)."""
    current = _POOL[-1] if _POOL else None
    if current is None or current[0] < workers:
        current = (workers, ThreadPoolExecutor(workers, thread_name_prefix="cohortgate-digest"))
        _POOL[:] = [current]
    return current[1]


def _kernel_sums(kernel: ModuleType, address: int, nbytes: int) -> bytes:
    """The C kernel over `nbytes` at `address` (a contiguous CPU tensor the caller holds), in
    whole chunks per thread (the kernel releases the GIL), this thread taking the first."""
    keys = _key_bytes()
    rows = -(-nbytes // CHUNK_BYTES)
    out = bytearray(rows * LANES * 8)
    per = max(1, -(-rows // _threads(nbytes)))  # rows is 0 for an empty tensor
    view = memoryview(out)
    parts = [
        (address + r * CHUNK_BYTES, min(nbytes, (r + per) * CHUNK_BYTES) - r * CHUNK_BYTES,
         view[r * LANES * 8 : (r + per) * LANES * 8])
        for r in range(0, rows, per)
    ]  # fmt: skip
    futures = []
    if len(parts) > 1:
        pool = _pool(len(parts) - 1)
        futures = [pool.submit(kernel.chunk_sums, at, n, keys, o) for at, n, o in parts[1:]]
    at, n, o = parts[0] if parts else (address, 0, view)
    kernel.chunk_sums(at, n, keys, o)
    for f in futures:
        f.result()
    return bytes(out)


def _torch_sums(flat: torch.Tensor, out: torch.Tensor) -> None:
    """The same sums from torch ops on `flat`'s device, block by block."""
    import torch

    keys = _keys(flat.device)
    whole = flat.numel() - flat.numel() % CHUNK_BYTES
    rows = whole // CHUNK_BYTES
    if rows:
        words = flat[:whole].view(torch.int32).reshape(rows, CHUNK)
        block = BLOCK_BYTES if flat.device.type == "cpu" else DEVICE_BLOCK_BYTES
        step = max(block // CHUNK_BYTES, 1)
        # Preallocated buffers: the words widened to int64 once (sign-extended by the copy,
        # then masked to their unsigned value), one multiply and one row sum per lane.
        wide = torch.empty((min(step, rows), CHUNK), dtype=torch.int64, device=flat.device)
        product = torch.empty_like(wide)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            w, p = wide[:n], product[:n]
            w.copy_(words[start : start + n])
            w.bitwise_and_(0xFFFFFFFF)
            for lane in range(LANES):
                torch.mul(w, keys[lane], out=p)
                torch.sum(p, dim=1, out=out[start : start + n, lane])
    if whole < flat.numel():
        tail = torch.zeros(CHUNK_BYTES, dtype=torch.uint8, device=flat.device)
        tail[: flat.numel() - whole] = flat[whole:]
        w = tail.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        for lane in range(LANES):
            out[rows, lane] = (w * keys[lane]).sum()


def chunk_sums(tensor: torch.Tensor, *, kernel: bool | None = None) -> bytes:
    """The chunk sums of `tensor`'s bytes, computed on its device: (chunks, LANES) int64,
    little-endian, as bytes (what the digest hashes; 1/1024 of the tensor's size). `kernel`:
    the C kernel for a CPU tensor (default: wherever it was built); False: torch ops, as on
    every other device."""
    import torch

    data = tensor.detach()
    if data.is_conj() or data.is_neg():  # lazy views: digest their values
        data = data.resolve_conj().resolve_neg()
    if not data.is_contiguous():
        data = data.contiguous()
    if data.data_ptr() % 4:  # a view at an odd byte offset: both paths read aligned words
        data = data.clone()
    nbytes = data.numel() * data.element_size()
    if data.device.type == "cpu" and (KERNEL if kernel is None else kernel):
        if _kernel is None:
            raise RuntimeError(
                "the digest's C kernel (cohortgate.agent._digest) was not built: reinstall "
                "cohortgate where a C compiler and the Python headers are present"
            )
        return _kernel_sums(_kernel, data.data_ptr(), nbytes)
    if data.device.type == "cpu" and kernel is None and not _WARNED:
        _WARNED.append(True)
        logging.getLogger("cohortgate.agent").warning(
            "weight digests of CPU tensors use torch ops, ~5x slower than the C kernel "
            "(cohortgate.agent._digest), which this install lacks: reinstall cohortgate where a C "
            "compiler and the Python headers are present"
        )
    flat = data.reshape(-1).view(torch.uint8)
    out = torch.empty((-(-nbytes // CHUNK_BYTES), LANES), dtype=torch.int64, device=flat.device)
    _torch_sums(flat, out)
    return out.cpu().numpy().astype("<i8", copy=False).tobytes()


def tensor_digest(name: str, tensor: torch.Tensor, *, kernel: bool | None = None) -> bytes:
    h = hashlib.sha256(FORMAT)
    header = f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{tuple(tensor.shape)}\0"
    h.update(header.encode())
    h.update(struct.pack("<Q", tensor.numel() * tensor.element_size()))
    h.update(chunk_sums(tensor, kernel=kernel))
    return h.digest()


def _local(tensor: Any) -> Any:
    """What this rank holds of `tensor`: a DTensor's local shard (FSDP2, tensor parallel),
    else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _undigestable(tensor: Any) -> str | None:
    """Why `tensor`'s values cannot be read as bytes here, or None."""
    import torch

    if tensor.is_meta:
        return (
            "it is a meta tensor (no values yet); materialise the weights before joining "
            "with verify_values=True"
        )
    if tensor.layout != torch.strided:
        return f"its layout is {tensor.layout}; only dense (strided) tensors are digested"
    if tensor.numel() and not tensor.data_ptr():
        return (
            f"a {type(tensor).__name__} holds no storage of its own (a wrapper subclass); "
            "digest the plain tensors it wraps, or join without verify_values"
        )
    return None


def weight_digests(module: torch.nn.Module) -> list[tuple[str, bytes]]:
    """(name, digest) of every parameter and buffer in manifest order (aliases of a tied
    tensor digest like the tensor they alias; a DTensor by its local shard)."""
    from cohortgate.agent.signature import walk

    out = []
    for name, tensor in walk(module):
        local = _local(tensor)
        problem = _undigestable(local)
        if problem is not None:
            raise ManifestError(f"cannot digest '{name}': {problem}")
        out.append((name, tensor_digest(name, local)))
    return out


def tensor_digests(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> list[tuple[str, bytes]]:
    """(name, digest) of every parameter and buffer in manifest order, then (with
    `optimizer`) of every tensor in its state, as `optimizer.state.<param>.<key>`."""
    out = weight_digests(model)
    if optimizer is not None:
        for index, state in sorted(optimizer.state_dict()["state"].items()):
            for key, value in sorted(state.items()):
                if hasattr(value, "data_ptr"):
                    name = f"optimizer.state.{index}.{key}"
                    out.append((name, tensor_digest(name, value)))
    return out
