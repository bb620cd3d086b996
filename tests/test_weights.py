"""Weight agreement: content digests where the tensors live, compared per replica class."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from agent.digest import (
    CHUNK,
    KERNEL,
    PARALLEL_BYTES,
    chunk_sums,
    tensor_digest,
    weight_digests,
)
from agent.signature import manifest as build_manifest
from coordinator.api.v1 import cohort_pb2 as pb
from coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from coordinator.cli.spawn import spawn
from coordinator.contract.manifest import ManifestError
from tests.helpers import (
    agent_rank,
    coordinator_process,
    join_request,
    kill_group,
    log_events,
)

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
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
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
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)  # type: ignore[attr-defined,no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(func)


def test_tensors_whose_bytes_cannot_be_read_are_refused_by_name() -> None:
    sparse = nn.Module()
    sparse.s = nn.Parameter(torch.randn(4, 4).to_sparse())
    with pytest.raises(ManifestError, match=r"cannot digest 's': its layout is torch\.sparse_coo"):
        weight_digests(sparse)
    wrapped = nn.Module()
    wrapped.register_buffer("q", _NoStorage(torch.zeros(3)))
    with pytest.raises(ManifestError, match="cannot digest 'q': a _NoStorage holds no storage"):
        weight_digests(wrapped)


def test_views_digest_their_values_and_meta_tensors_are_refused() -> None:
    t = torch.randn(64, 32)
    assert tensor_digest("t", t.t()) == tensor_digest("t", t.t().contiguous())
    with pytest.raises(ManifestError, match="meta tensor"):
        weight_digests(nn.Linear(4, 4, device="meta"))


def sums_of(t: torch.Tensor, kernel: bool | None = None) -> np.ndarray:
    from agent.digest import LANES

    return np.frombuffer(chunk_sums(t, kernel=kernel), "<u8").reshape(-1, LANES)


def reference_sums(t: torch.Tensor) -> np.ndarray:
    """The chunk sums by the algorithm's definition, in numpy (wrapping uint64 arithmetic):
    an independent check of what every device and both CPU paths must compute."""
    from agent.digest import LANES, _key_bytes

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


def test_the_cpu_kernel_is_built_and_splits_big_tensors_across_threads() -> None:
    # The dev install (make venv) builds agent/_digest.c; without it CPU digests fall back to
    # torch ops (same sums, ~5x slower) and this is what says so.
    assert KERNEL, "agent._digest was not built: pip install -e . needs a C compiler"
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
    # A process where agent._digest cannot be imported, as on an install without a compiler.
    script = (
        "import sys; sys.modules['agent._digest'] = None\n"
        "import torch\n"
        "from agent.digest import KERNEL, tensor_digest\n"
        "assert not KERNEL\n"
        "t = torch.arange(10000, dtype=torch.float32)\n"
        "print(tensor_digest('w', t).hex(), tensor_digest('w', t).hex())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    expected = tensor_digest("w", torch.arange(10000, dtype=torch.float32)).hex()
    assert done.stdout.split() == [expected, expected]
    assert done.stderr.count("use torch ops, ~5x slower than the C kernel") == 1, done.stderr


def test_the_kernel_rejects_buffers_of_the_wrong_size() -> None:
    from agent import _digest
    from agent.digest import _key_bytes

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


# -- the coordinator's check -------------------------------------------------------------
@pytest.fixture
def strict(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    with coordinator_process(
        "--join-deadline", "30", "--policy", "weights=strict", tmp=tmp_path
    ) as served:
        yield served


def cohort(addr: str, job: str, models: Mapping[int, nn.Module], **kw: Any) -> list[pb.Verdict]:
    def rank(r: int) -> pb.Verdict:
        m = models[r]
        digests = None if kw.get("no_digest") == r else [d for _, d in weight_digests(m)]
        return agent_rank(
            addr,
            job,
            r,
            len(models),
            build_manifest(m),
            30,
            digests=digests,
            sharded_without_layout=kw.get("sharded", False),
        )

    with ThreadPoolExecutor(len(models)) as pool:
        return list(pool.map(rank, sorted(models)))


def test_same_seed_forms(strict: tuple[str, Path]) -> None:
    addr, log = strict
    verdicts = cohort(addr, "same", {r: model() for r in range(4)})
    assert {v.outcome for v in verdicts} == {pb.Verdict.OUTCOME_FORMED}
    assert not [e for e in log_events(log) if e.get("event") == "weight digests uploaded"]


def test_another_seed_is_refused_naming_the_first_differing_tensor(
    strict: tuple[str, Path],
) -> None:
    addr, log = strict
    verdicts = cohort(addr, "seed", {r: model(seed=7 if r == 2 else 0) for r in range(4)})
    assert {v.outcome for v in verdicts} == {pb.Verdict.OUTCOME_REFUSED}
    assert len({v.refusal.report for v in verdicts}) == 1
    v = verdicts[0]
    assert v.refusal.cause == pb.Refusal.CAUSE_WEIGHTS
    report = v.refusal.report
    assert "replicas start from different weights" in report
    assert "1 rank(s) [2] on node0 hold other weights than ranks [0-1,3]" in report, report
    assert "4 of 6 tensors differ, first '0.weight', '0.bias', '2.weight', '2.bias'" in report
    uploads = [e for e in log_events(log) if e.get("event") == "weight digests uploaded"]
    assert sorted(e["rank"] for e in uploads) == [0, 2], "one digest list per class"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_one_changed_element_is_refused_naming_exactly_that_tensor(
    strict: tuple[str, Path], dtype: torch.dtype
) -> None:
    addr, _ = strict
    models = {r: model(dtype=dtype) for r in range(4)}
    flip_one_bit(models[1][2].weight, 17)
    verdicts = cohort(addr, f"poke-{dtype}", models)
    assert {v.outcome for v in verdicts} == {pb.Verdict.OUTCOME_REFUSED}
    assert "1 of 6 tensors differ, first '2.weight'" in verdicts[0].refusal.report


def test_a_rank_without_digest_is_refused_under_strict(strict: tuple[str, Path]) -> None:
    addr, _ = strict
    verdicts = cohort(addr, "nodigest", {r: model() for r in range(3)}, no_digest=1)
    assert {v.outcome for v in verdicts} == {pb.Verdict.OUTCOME_REFUSED}
    report = verdicts[0].refusal.report
    assert "1 rank(s) 1 sent no weight digest" in report
    # its own headline and advice, not the seed advice
    assert "some ranks sent no weight digest, which the weights check (strict) requires" in report
    assert "verify_values=True" in report and "seed every rank alike" not in report


class Rotary(nn.Module):
    """A Llama-like block: a rotary buffer computed from the config's rope_theta."""

    def __init__(self, rope_theta: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        freq = 1.0 / (rope_theta ** (torch.arange(0, 8, 2).float() / 8))
        self.register_buffer("inv_freq", freq, persistent=False)


def test_a_config_difference_caught_in_buffers_is_not_called_a_seed_problem(
    strict: tuple[str, Path],
) -> None:
    addr, _ = strict
    models = {r: Rotary(500000.0 if r == 3 else 10000.0) for r in range(4)}
    report = cohort(addr, "rope", models)[0].refusal.report
    assert "buffers computed from the model config differ" in report, report
    assert "first 'inv_freq'" in report and "rope_theta" in report
    assert "seed every rank alike" not in report


def test_sharded_weights_without_a_layout_say_to_declare_one(strict: tuple[str, Path]) -> None:
    addr, _ = strict
    verdicts = cohort(addr, "fsdp", {r: model(seed=r) for r in range(2)}, sharded=True)
    report = verdicts[0].refusal.report
    assert "sharded DTensors (FSDP2 / tensor parallel) and no layout was declared" in report
    assert "declare the layout" in report and "seed every rank alike" not in report


def test_warn_forms_and_off_ignores(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "30", "--policy", "weights=warn", tmp=tmp_path) as (
        addr,
        _,
    ):
        verdicts = cohort(addr, "warned", {r: model(seed=r) for r in range(3)})
    assert {v.outcome for v in verdicts} == {pb.Verdict.OUTCOME_FORMED}
    assert any("hold other weights" in w for w in verdicts[0].warnings), verdicts[0].warnings
    with coordinator_process("--join-deadline", "30", tmp=tmp_path) as (addr, _):
        verdicts = cohort(addr, "default-off", {r: model(seed=r) for r in range(3)})
    assert {v.outcome for v in verdicts} == {pb.Verdict.OUTCOME_FORMED}
    assert not list(verdicts[0].warnings)


def test_bad_digest_uploads_get_clear_errors(strict: tuple[str, Path]) -> None:
    addr, _ = strict
    m = build_manifest(model())
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        for digest, fmt, code, says in (
            (b"x" * 31, 2, grpc.StatusCode.INVALID_ARGUMENT, "weights_digest is 31 bytes"),
            # an agent computing another digest function (another version), or not saying
            (b"x" * 32, 1, grpc.StatusCode.FAILED_PRECONDITION, "is in format 1, this "),
            (b"x" * 32, 0, grpc.StatusCode.FAILED_PRECONDITION, "compares format 2"),
        ):
            req = join_request("bad", 0, 2, m, weights_digest=digest, weights_digest_format=fmt)
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Join(req, timeout=5))
            assert caught.value.code() == code
            assert says in (caught.value.details() or "")
        with pytest.raises(grpc.RpcError) as caught:
            stub.UploadDigests(
                pb.UploadDigestsRequest(job_id="nobody", round=1, rank=0, incarnation="x"),
                timeout=5,
            )
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_digests_pass_through_a_relay(strict: tuple[str, Path], tmp_path: Path) -> None:
    addr, log = strict
    proc, port = spawn(
        tmp_path / "relay-port",
        ["--upstream", addr, "--listen", "127.0.0.1:0", "--local-ranks", "2"],
        stdout=subprocess.DEVNULL,
        new_session=True,
        command="relay",
    )
    try:
        verdicts = cohort(
            f"127.0.0.1:{port}", "relayed", {r: model(seed=5 if r == 3 else 0) for r in range(4)}
        )
    finally:
        kill_group(proc)
    assert {v.outcome for v in verdicts} == {pb.Verdict.OUTCOME_REFUSED}
    assert "1 rank(s) [3] on node0 hold other weights" in verdicts[0].refusal.report
    uploads = [e for e in log_events(log) if e.get("event") == "weight digests uploaded"]
    assert sorted(e["rank"] for e in uploads) == [0, 3]


def test_a_refusal_where_only_some_classes_differ_in_buffers_is_about_values(
    strict: tuple[str, Path],
) -> None:
    """Rank 2 differs only in a buffer, rank 3 in a parameter: not every pair differs only
    in buffers, so the refusal is about the values, not the config's buffers."""
    addr, _ = strict
    models = {r: Rotary(500000.0 if r == 2 else 10000.0) for r in range(4)}
    flip_one_bit(models[3].proj.weight, 5)
    report = cohort(addr, "rope-and-seed", models)[0].refusal.report
    assert "buffers computed from the model config differ" not in report, report
    assert "replicas start from different weights" in report, report
