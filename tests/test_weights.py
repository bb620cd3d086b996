"""Weight agreement: content digests where the tensors live, compared per replica class."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from torch import nn

from cohortgate.agent.digest import (
    weight_digests,
)
from cohortgate.agent.signature import manifest as build_manifest
from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.cli.spawn import spawn
from tests.helpers import join_request, log_events
from tests.launches import agent_rank, coordinator_process, kill_group
from tests.test_digest import flip_one_bit, model


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
