"""Audits during training over real gRPC: a real coordinator, a cohort formed by real join
streams, then rank audits as the agent sends them (and hostile ones)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from tests.helpers import (
    InProcessCoordinator,
    manifest_of,
    metric_total,
    one_cohort,
    rank_audit,
    run_cohort,
    sha,
    tensors_of,
)

pytestmark = pytest.mark.timeout(60)
CLI = [sys.executable, "-m", "cohortgate.coordinator.cli"]


@pytest.fixture
def coordinator() -> Iterator[InProcessCoordinator]:
    c = InProcessCoordinator(join_deadline=20, audit_timeout=2.0)
    try:
        yield c
    finally:
        c.stop()


def formed(addr: str, job: str, world: int = 4) -> pb.Verdict:
    m = manifest_of()
    return one_cohort(
        run_cohort(addr, job, dict.fromkeys(range(world), m)), pb.Verdict.OUTCOME_FORMED
    )


def send(addr: str, *audits: pb.RankAudit) -> pb.AuditReply:
    with grpc.insecure_channel(addr) as ch:
        reply: pb.AuditReply = pb_grpc.CohortServiceStub(ch).Audit(
            pb.AuditRequest(audits=list(audits)), timeout=10
        )
    return reply


def refused(addr: str, *audits: pb.RankAudit) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        send(addr, *audits)
    err = caught.value
    return err.code(), err.details() or ""


def list_audits(addr: str, job: str) -> list[pb.AuditRecord]:
    with grpc.insecure_channel(addr) as ch:
        found = pb_grpc.StatusServiceStub(ch).ListAudits(pb.ListAuditsRequest(job_id=job))
    return list(found.audits)


def metric(c: InProcessCoordinator, name: str) -> float:
    return metric_total(c.metrics_url, name)


def test_a_rank_that_diverged_is_named_after_its_tensors_are_asked_for(
    coordinator: InProcessCoordinator,
) -> None:
    addr = coordinator.addr
    v = formed(addr, "aud-grpc")
    for step in range(3):  # clean: nothing asked, nothing found
        for r in range(4):
            (answer,) = send(addr, rank_audit(v, r, step)).answers
            assert answer.level == "warn" and not answer.report and not answer.tensors_rank
    # a relay's batch: the node's ranks in one request; rank 2's weights changed at step 3
    (answer,) = send(addr, *(rank_audit(v, r, 3, odd=r == 2) for r in range(4))).answers
    asked = sorted(zip(answer.tensors_rank, answer.tensors_step, strict=True))
    assert asked == [(0, 3), (2, 3)]
    send(addr, tensors_of(v, 0, 3))
    (answer,) = send(addr, tensors_of(v, 2, 3, odd="fc.bias")).answers
    assert answer.headline == (
        "replicas diverged at step 3: rank 2 on host0 differs from ranks 0-1,3 in fc.bias"
    )
    assert answer.diverged_step == 3 and answer.stop_step == 0
    assert "1 tensor of 2 differs: fc.bias (rank 2 against rank 0)" in answer.report
    (record,) = list_audits(addr, "aud-grpc")
    assert (record.kind, record.step, record.level) == ("diverged", 3, "warn")
    assert record.report == answer.report
    assert metric(coordinator, 'cohortgate_replica_divergence_total{level="warn"}') == 1
    assert metric(coordinator, "cohortgate_audited_steps_total") == 4
    # the ranks still auditing are each told, the same text
    for r in range(4):
        (again,) = send(addr, rank_audit(v, r, 4, odd=r == 2)).answers
        assert again.report == answer.report and not again.tensors_rank

    explain = subprocess.run(
        [*CLI, "explain", "aud-grpc", "--audits", "--addr", addr, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert explain.returncode == 0, explain.stderr
    (said,) = json.loads(explain.stdout)
    assert said["kind"] == "diverged" and said["report"] == answer.report
    assert (said["step"], said["stop_step"]) == (3, 0)


def test_strict_gives_every_rank_the_same_stop_step(coordinator: InProcessCoordinator) -> None:
    strict = InProcessCoordinator(join_deadline=20, policy="audit=strict")
    try:
        v = formed(strict.addr, "aud-strict")
        for step in range(4):
            send(strict.addr, *(rank_audit(v, r, step, odd=r == 1 and step == 3) for r in range(4)))
        send(strict.addr, tensors_of(v, 0, 3), tensors_of(v, 1, 3, odd="fc.weight"))
        stops = {send(strict.addr, rank_audit(v, r, 4)).answers[0].stop_step for r in range(4)}
        (stop,) = stops
        assert stop >= 3 + 2
    finally:
        strict.stop()


def test_a_rank_that_sends_no_audit_is_named_with_its_host_at_the_bound(
    coordinator: InProcessCoordinator,
) -> None:
    addr = coordinator.addr
    v = formed(addr, "aud-missing")
    send(addr, *(rank_audit(v, r, 0) for r in (0, 1, 2)))  # rank 3 never audits
    give_up = time.monotonic() + 20
    while not list_audits(addr, "aud-missing"):
        assert time.monotonic() < give_up, "the missing rank was never named"
        time.sleep(0.1)
    (record,) = list_audits(addr, "aud-missing")
    assert record.kind == "missing"
    assert record.headline == "step 0: rank 3 on host0 sent no audit in time"
    assert metric(coordinator, "cohortgate_audit_missing_total") == 1


@pytest.mark.parametrize(
    ("change", "code", "said"),
    [
        ({"cohort_id": "other-job/1/abcd"}, "INVALID_ARGUMENT", "is not a cohort of job"),
        ({"cohort_id": "aud-bad/1/ffffffff"}, "FAILED_PRECONDITION", "formed as cohort"),
        ({"rank": 9}, "INVALID_ARGUMENT", "rank 9 is outside the world size 4"),
        ({"world_size": 0}, "INVALID_ARGUMENT", "world_size 0 is outside"),
        ({"digest": b"short"}, "INVALID_ARGUMENT", "digest"),
        ({"digest_format": 1}, "FAILED_PRECONDITION", "digest_format 1"),
        ({"digest": b""}, "INVALID_ARGUMENT", "carries a digest, per-tensor digests, or both"),
        ({"step": 1 << 63}, "INVALID_ARGUMENT", "past 2^62"),
        ({"job_id": ""}, "INVALID_ARGUMENT", "job_id"),
    ],
)
def test_a_bad_audit_is_refused_with_a_clear_error_and_harms_no_cohort(
    coordinator: InProcessCoordinator, change: dict[str, object], code: str, said: str
) -> None:
    addr = coordinator.addr
    v = formed(addr, "aud-bad")
    bad = rank_audit(v, 0, 0)
    for name, value in change.items():
        setattr(bad, name, value)
    got, details = refused(addr, bad)
    assert (got.name, said in details) == (code, True), details
    # the cohort's own audits are still taken and compared
    for r in range(4):
        (answer,) = send(addr, rank_audit(v, r, 0)).answers
    assert not answer.report and list_audits(addr, "aud-bad") == []


def test_a_batch_of_two_jobs_or_too_many_is_refused(coordinator: InProcessCoordinator) -> None:
    addr = coordinator.addr
    a, b = formed(addr, "aud-a", 2), formed(addr, "aud-b", 2)
    code, details = refused(addr, rank_audit(a, 0, 0), rank_audit(b, 0, 0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "one job only" in details
    code, details = refused(addr)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "holds no audits" in details
    code, details = refused(addr, *(rank_audit(a, 0, s) for s in range(1025)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit is 1024" in details


def test_tensor_names_and_digests_must_pair(coordinator: InProcessCoordinator) -> None:
    v = formed(coordinator.addr, "aud-pairs", 2)
    a = tensors_of(v, 0, 0)
    a.tensor_digests.append(sha(b"x"))
    code, details = refused(coordinator.addr, a)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "2 tensor names for 3 digests" in details


def test_audit_off_takes_audits_and_compares_nothing() -> None:
    off = InProcessCoordinator(join_deadline=20, policy="audit=off")
    try:
        v = formed(off.addr, "aud-off", 2)
        (answer,) = send(off.addr, rank_audit(v, 0, 0), rank_audit(v, 1, 0, odd=True)).answers
        assert answer.level == "off" and not answer.tensors_rank and not answer.report
    finally:
        off.stop()


def test_audits_outlive_the_jobs_retention_and_are_still_compared() -> None:
    """--job-retention forgets a decided job (its verdict stays in the history); the job
    trains on for hours, and its audits are kept by cohort id for as long as it audits."""
    short = InProcessCoordinator(join_deadline=20, job_retention=0.2)
    try:
        v = formed(short.addr, "aud-long", 2)
        send(short.addr, rank_audit(v, 0, 0), rank_audit(v, 1, 0))
        give_up = time.monotonic() + 10
        while short.call(short.running.coordinator.store.holds, "aud-long"):
            assert time.monotonic() < give_up, "the job was never forgotten"
            time.sleep(0.1)
        send(short.addr, rank_audit(v, 0, 1))
        (answer,) = send(short.addr, rank_audit(v, 1, 1, odd=True)).answers
        assert sorted(zip(answer.tensors_rank, answer.tensors_step, strict=True)) == [
            (0, 1),
            (1, 1),
        ]
    finally:
        short.stop()


def test_the_optimizer_state_is_digested_with_the_weights() -> None:
    import torch

    from cohortgate.agent.digest import tensor_digests

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    names = [n for n, _ in tensor_digests(model, opt)]
    assert names[:2] == ["weight", "bias"]
    assert "optimizer.state.0.exp_avg" in names and "optimizer.state.1.exp_avg_sq" in names
    before = dict(tensor_digests(model, opt))
    with torch.no_grad():
        opt.state[model.weight]["exp_avg"][0, 0] += 1e-3
    after = dict(tensor_digests(model, opt))
    assert [n for n in before if before[n] != after[n]] == ["optimizer.state.0.exp_avg"]
