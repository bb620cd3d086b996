"""The weight digest (cohortgate.agent.digest): content digests computed where the tensors live,
with the C kernel and with torch ops, against the definition."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from cohortgate.agent.digest import (
    CHUNK,
    KERNEL,
    PARALLEL_BYTES,
    chunk_sums,
    tensor_digest,
    weight_digests,
)
from cohortgate.coordinator.contract.manifest import ManifestError

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


def model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8), nn.LayerNorm(8)).to(dtype)


def flip_one_bit(t: Any, index: int) -> None:
    """Change exactly one element's bytes in place (its lowest bit), whatever the dtype."""
    raw = t.data.view(-1).view(torch.uint8)
    raw[index * t.element_size()] ^= 1


# -- the digest itself -----------------------------------------------------------------
def test_equal_bytes_digest_equal_and_one_element_changes_only_its_tensor() -> None:
    a, b = model(), model()
    assert weight_digests(a) == weight_digests(b)
    flip_one_bit(b[2].bias, 3)
    da, db = dict(weight_digests(a)), dict(weight_digests(b))
    assert [n for n in da if da[n] != db[n]] == ["2.bias"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, *FLOAT8, torch.bool])
def test_every_dtype_is_digested_by_its_bytes(dtype: torch.dtype) -> None:
    base = torch.randn(3, 1000, generator=torch.Generator().manual_seed(1))
    t = (base > 0) if dtype is torch.bool else base.to(dtype)
    same = t.clone()
    assert tensor_digest("w", t) == tensor_digest("w", same)
    flip_one_bit(same, 1234)
    assert tensor_digest("w", t) != tensor_digest("w", same)
    # the dtype is part of the identity: the same bytes as another dtype digest differently
    if t.element_size() == 1 and dtype is not torch.uint8:
        assert tensor_digest("w", t) != tensor_digest("w", t.view(torch.uint8))


@pytest.mark.parametrize("nbytes", [1, 3, 4 * CHUNK - 1, 4 * CHUNK, 4 * CHUNK * 3 + 5])
def test_tails_and_chunk_edges(nbytes: int) -> None:
    t = torch.randint(
        0, 255, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )
    for i in {0, nbytes // 2, nbytes - 1}:
        other = t.clone()
        other[i] ^= 0x80
        assert tensor_digest("t", t) != tensor_digest("t", other), i
    # zero padding of the tail is not confused with real zeros: a longer tensor differs
    assert tensor_digest("t", t) != tensor_digest(
        "t", torch.cat([t, torch.zeros(1, dtype=torch.uint8)])
    )


@pytest.mark.parametrize("kernel", [True, False])
def test_empty_and_zero_dim_tensors(kernel: bool) -> None:
    # an empty parameter, and BatchNorm's 0-dim num_batches_tracked buffer
    net = nn.Module()
    net.empty = nn.Parameter(torch.empty(0, 3))
    net.bn = nn.BatchNorm1d(3)
    digests = [tensor_digest(n, t, kernel=kernel) for n, t in net.state_dict().items()]
    assert digests == [d for _, d in weight_digests(net)]
    assert sums_of(torch.empty(0, 5), kernel=kernel).shape == (0, 2)
    # the shape is part of the identity even when there are no bytes
    assert tensor_digest("e", torch.empty(0, 5), kernel=kernel) != tensor_digest(
        "e", torch.empty(5, 0), kernel=kernel
    )
    scalar = torch.tensor(7, dtype=torch.int64)
    assert np.array_equal(sums_of(scalar, kernel=kernel), reference_sums(scalar))


def test_dtensors_digest_their_local_shard() -> None:
    """FSDP2 and tensor-parallel parameters are DTensors: each rank digests what it holds
    (on a one-rank gloo mesh here, since a DTensor needs a process group)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w, b = torch.randn(8, 4), torch.randn(4)
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        net = nn.Module()
        net.w = nn.Parameter(distribute_tensor(w, mesh, [Shard(0)]))
        net.b = nn.Parameter(distribute_tensor(b, mesh, [Replicate()]))
        digests = weight_digests(net)
    finally:
        dist.destroy_process_group()
    assert digests == [("w", tensor_digest("w", w)), ("b", tensor_digest("b", b))]


class _NoStorage(torch.Tensor):
    """A wrapper subclass with no storage of its own (as some quantisation libraries make)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> _NoStorage:
        made: _NoStorage = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)
        return made

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise NotImplementedError(func)


def test_tensors_whose_bytes_cannot_be_read_are_refused_by_name() -> None:
    sparse = nn.Module()
    sparse.s = nn.Parameter(torch.randn(4, 4).to_sparse())
    with pytest.raises(ManifestError, match=r"cannot digest 's': its layout is torch\.sparse_coo"):
        weight_digests(sparse)
    wrapped = nn.Module()
    wrapped.register_buffer("q", _NoStorage(torch.zeros(3)))
    with pytest.raises(ManifestError) as raised:
        weight_digests(wrapped)
    assert str(raised.value) == (
        "cannot digest 'q': a _NoStorage holds no storage of its own (a wrapper subclass); "
        "digest the plain tensors it wraps, or join without verify_values"
    )


def test_views_digest_their_values_and_meta_tensors_are_refused() -> None:
    t = torch.randn(64, 32)
    assert tensor_digest("t", t.t()) == tensor_digest("t", t.t().contiguous())
    with pytest.raises(ManifestError) as raised:
        weight_digests(nn.Linear(4, 4, device="meta"))
    assert str(raised.value) == (
        "cannot digest 'weight': it is a meta tensor (no values yet); materialise the weights "
        "before joining with verify_values=True"
    )


def sums_of(t: torch.Tensor, kernel: bool | None = None) -> np.ndarray:
    from cohortgate.agent.digest import LANES

    return np.frombuffer(chunk_sums(t, kernel=kernel), "<u8").reshape(-1, LANES)


def reference_sums(t: torch.Tensor) -> np.ndarray:
    """The chunk sums by the algorithm's definition, in numpy (wrapping uint64 arithmetic):
    an independent check of what every device and both CPU paths must compute."""
    from cohortgate.agent.digest import LANES, _key_bytes

    raw = np.frombuffer(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), np.uint8)
    padded = np.zeros(-(-raw.size // (4 * CHUNK)) * 4 * CHUNK, np.uint8)
    padded[: raw.size] = raw
    words = padded.view("<u4").astype(np.uint64).reshape(-1, CHUNK)
    keys = np.frombuffer(_key_bytes(), "<u4").astype(np.uint64).reshape(LANES, CHUNK)
    with np.errstate(over="ignore"):
        return np.stack([(words * keys[lane]).sum(axis=1) for lane in range(LANES)], axis=1)


# Every way this machine computes digests: the CPU's C kernel and the CPU's torch ops always,
# CUDA where present. Each must agree with the definition above and with the others, bit
# for bit.
PATHS = [("cpu", True), ("cpu", False)] + ([("cuda", False)] if torch.cuda.is_available() else [])


@pytest.mark.parametrize(("device", "kernel"), PATHS)
def test_digests_agree_with_the_definition_on_every_device(device: str, kernel: bool) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = torch.randn(1237, 129, generator=torch.Generator().manual_seed(3)).to(dtype)
        sums = sums_of(t.to(device), kernel=kernel)
        assert np.array_equal(sums, reference_sums(t)), dtype
        assert tensor_digest("w", t.to(device)) == tensor_digest("w", t)
    assert weight_digests(model().to(device)) == weight_digests(model())
    # Past one block of the torch ops (BLOCK_BYTES), ending in a part block and a part chunk
    big = torch.randn(1_310_811, generator=torch.Generator().manual_seed(4))
    assert np.array_equal(sums_of(big.to(device), kernel=kernel), reference_sums(big))


def test_the_cpu_kernel_is_built_and_splits_big_tensors_across_threads() -> None:
    # The dev install (make venv) builds agent/_digest.c; without it CPU digests fall back to
    # torch ops (same sums, ~5x slower) and this is what says so.
    assert KERNEL, "cohortgate.agent._digest was not built: pip install -e . needs a C compiler"
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        # three threads' worth of whole chunks plus a 5-byte tail, one bit changed in each
        t = torch.randint(
            0, 255, (3 * PARALLEL_BYTES + 5,), dtype=torch.uint8,
            generator=torch.Generator().manual_seed(4),
        )  # fmt: skip
        sums = sums_of(t)
        assert np.array_equal(sums, reference_sums(t))
        assert np.array_equal(sums, sums_of(t, kernel=False))
        for i in (0, PARALLEL_BYTES + 7, 2 * PARALLEL_BYTES + 1, t.numel() - 1):
            other = t.clone()
            other[i] ^= 0x80
            changed = np.flatnonzero((sums_of(other) != sums).any(axis=1))
            assert changed.tolist() == [i // (4 * CHUNK)], i
    finally:
        torch.set_num_threads(threads)


def test_without_the_kernel_cpu_digests_are_the_same_and_say_so_once() -> None:
    # A process where cohortgate.agent._digest cannot be imported (an install without a
    # compiler), importing the cohortgate this test imports (under `make mutation`, the
    # mutated one).
    import cohortgate

    script = (
        "import logging, sys; sys.modules['cohortgate.agent._digest'] = None\n"
        "logging.basicConfig(format='%(name)s %(levelname)s %(message)s')\n"
        "import torch\n"
        "from cohortgate.agent.digest import KERNEL, chunk_sums, tensor_digest\n"
        "assert not KERNEL\n"
        "t = torch.arange(10000, dtype=torch.float32)\n"
        "print(tensor_digest('w', t).hex(), tensor_digest('w', t).hex())\n"
        "try:\n"
        "    chunk_sums(t, kernel=True)\n"
        "except RuntimeError as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(cohortgate.__file__).parent.parent)}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    expected = tensor_digest("w", torch.arange(10000, dtype=torch.float32)).hex()
    first, asked = done.stdout.split("\n", 1)
    assert first.split() == [expected, expected]
    assert asked.strip() == (
        "the digest's C kernel (cohortgate.agent._digest) was not built: reinstall cohortgate "
        "where a C compiler and the Python headers are present"
    )
    assert done.stderr == (
        "cohortgate.agent WARNING weight digests of CPU tensors use torch ops, ~5x slower than "
        "the C kernel (cohortgate.agent._digest), which this install lacks: reinstall "
        "cohortgate where a C compiler and the Python headers are present\n"
    ), done.stderr


def test_lazy_and_unaligned_views_digest_their_values() -> None:
    """A conjugate or negative view holds its values lazily, a view at an odd byte offset
    is unaligned: each digests as the tensor of its values does, on both CPU paths."""
    z = torch.randn(64, dtype=torch.complex64, generator=torch.Generator().manual_seed(5))
    raw = torch.arange(4099, dtype=torch.uint8)
    for kernel in (True, False):
        for view, values in (
            (z.conj(), z.conj().resolve_conj()),
            (torch._neg_view(z), (-z).clone()),
            (raw[1:], raw[1:].clone()),
        ):
            assert tensor_digest("v", view, kernel=kernel) == tensor_digest(
                "v", values, kernel=kernel
            ), (kernel, view.is_conj(), view.is_neg())


def test_the_kernel_rejects_buffers_of_the_wrong_size() -> None:
    from cohortgate.agent import _digest
    from cohortgate.agent.digest import _key_bytes

    t = torch.arange(8, dtype=torch.uint8)
    at, keys = t.data_ptr(), _key_bytes()
    with pytest.raises(ValueError, match="keys are 3 bytes"):
        _digest.chunk_sums(at, 4, b"abc", bytearray(16))
    with pytest.raises(ValueError, match="out is 32 bytes; 1 chunks need 16"):
        _digest.chunk_sums(at, 4, keys, bytearray(32))
    with pytest.raises(ValueError, match="4-byte aligned"):
        _digest.chunk_sums(at + 1, 4, keys, bytearray(16))
    with pytest.raises(ValueError, match="address is 0"):
        _digest.chunk_sums(0, 4, keys, bytearray(16))
    with pytest.raises(TypeError):
        _digest.chunk_sums(at, 4, keys, b"read-only out...")
    # and views at odd byte offsets (not 4-byte aligned) are digested through a copy
    u = torch.randint(0, 255, (4 * CHUNK + 9,), dtype=torch.uint8)
    h = torch.randn(3 * CHUNK).to(torch.bfloat16)
    for view in (u[1:], u[2:-1], h[1:]):
        for kernel in (True, False):
            assert np.array_equal(sums_of(view, kernel=kernel), reference_sums(view))
