"""Weight agreement: content digests where the tensors live, compared per replica class."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from torch import nn

from agent.digest import CHUNK, chunk_sums, tensor_digest, weight_digests
from agent.signature import manifest as build_manifest
from coordinator.api.v1 import cohort_pb2 as pb
from coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from coordinator.manifest import ManifestError
from coordinator.spawn import spawn
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


def test_views_digest_their_values_and_meta_tensors_are_refused() -> None:
    t = torch.randn(64, 32)
    assert tensor_digest("t", t.t()) == tensor_digest("t", t.t().contiguous())
    with pytest.raises(ManifestError, match="meta tensor"):
        weight_digests(nn.Linear(4, 4, device="meta"))


def reference_sums(t: torch.Tensor) -> np.ndarray:
    """The chunk sums by the algorithm's definition, in numpy (wrapping uint64 arithmetic):
    an independent check of what every device must compute."""
    from agent.digest import LANES, _keys

    raw = np.frombuffer(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), np.uint8)
    padded = np.zeros(-(-raw.size // (4 * CHUNK)) * 4 * CHUNK, np.uint8)
    padded[: raw.size] = raw
    words = padded.view("<i4").astype(np.int64).view(np.uint64).reshape(-1, CHUNK)
    keys = _keys(torch.device("cpu")).numpy().view(np.uint64)
    with np.errstate(over="ignore"):
        return np.stack([(words * keys[lane]).sum(axis=1) for lane in range(LANES)], axis=1)


# Every device this machine has: the CPU always, CUDA where present. Each must agree with the
# definition above and with the CPU, bit for bit.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_digests_agree_with_the_definition_on_every_device(device: str) -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn):
        t = torch.randn(1237, 129, generator=torch.Generator().manual_seed(3)).to(dtype)
        sums = chunk_sums(t.to(device)).cpu().numpy().view(np.uint64)
        assert np.array_equal(sums, reference_sums(t)), dtype
        assert tensor_digest("w", t.to(device)) == tensor_digest("w", t)
    assert weight_digests(model().to(device)) == weight_digests(model())


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
        return agent_rank(addr, job, r, len(models), build_manifest(m), 30, digests=digests)

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
    assert "1 rank(s) 1 sent no weight digest" in verdicts[0].refusal.report


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
        for digest, code in ((b"x" * 31, grpc.StatusCode.INVALID_ARGUMENT),):
            req = join_request("bad", 0, 2, m, weights_digest=digest)
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Join(req, timeout=5))
            assert caught.value.code() == code
            assert "weights_digest is 31 bytes" in (caught.value.details() or "")
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
