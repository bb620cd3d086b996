"""Relays as processes: a node's ranks through a relay form as groups, refusals and upstream
errors reach every rank, racks of relays join as one call (joins and audits), and
`cohortgate run` joins through its node relay."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.cli.spawn import spawn
from cohortgate.coordinator.contract.manifest import Manifest
from tests.helpers import (
    REPO,
    RankResult,
    join_request,
    log_events,
    manifest_of,
    metric_total,
    one_cohort,
    rank_audit,
    run_cohort,
    run_rank,
    tensors_of,
)
from tests.launches import coordinator_process, kill_group, launch
from tests.relays import audit_step

FORMED = pb.Verdict.OUTCOME_FORMED
REFUSED = pb.Verdict.OUTCOME_REFUSED


# The rack's relays poll upstream (JoinPoll); the others keep the default, a stream.
POLL = ("--upstream-rpc", "poll")


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """A coordinator process and a relay process in front of it: (relay, coordinator, log)."""
    with coordinator_process(
        "--join-deadline", "30", "--log-level", "debug", "--progress-interval", "0.2", tmp=tmp_path
    ) as (addr, log):
        proc, port = spawn(
            tmp_path / "relay-port",
            ["--upstream", addr, "--listen", "127.0.0.1:0", "--local-ranks", "4"],
            stdout=open(tmp_path / "relay.log", "wb"),  # noqa: SIM115 (closed with the process)
            new_session=True,
            command="relay",
        )
        try:
            yield f"127.0.0.1:{port}", addr, log
        finally:
            kill_group(proc)


def joined_groups(log: Path) -> list[int]:
    """Per rank joined, the size of the call it joined in (one log line per call)."""
    return [
        int(e["group"])
        for e in log_events(log)
        if e.get("event") == "ranks joined"
        for _ in range(int(e["count"]))
    ]


def test_ranks_through_a_relay_form_as_groups(relay: tuple[str, str, Path]) -> None:
    relay_addr, _, log = relay
    m = manifest_of()
    results = run_cohort(relay_addr, "r", dict.fromkeys(range(8), m))
    assert all(r.verdict is not None and r.verdict.outcome == FORMED for r in results)
    assert len({r.verdict.cohort_id for r in results if r.verdict}) == 1
    assert results[0].verdict is not None
    assert results[0].verdict.init_method == "tcp://127.0.0.1:29999"
    assert sum(r.manifest_requests for r in results) == 1
    # A group hears its round only if it waits a progress interval (see
    # test_grpc_formation: the first progress event waits one interval).
    assert all(p.round == 1 for r in results for p in r.progress)
    groups = joined_groups(log)
    assert len(groups) == 8 and max(groups) > 1, f"the coordinator saw groups {groups}"


def test_a_refusal_through_a_relay_reaches_every_rank(relay: tuple[str, str, Path]) -> None:
    relay_addr, _, _ = relay
    m = manifest_of()
    manifests = {r: (manifest_of(dtype="bfloat16") if r == 5 else m) for r in range(8)}
    results = run_cohort(relay_addr, "rr", manifests)
    assert all(r.verdict is not None and r.verdict.outcome == REFUSED for r in results)
    reports = {r.verdict.refusal.report for r in results if r.verdict}
    assert len(reports) == 1
    report = reports.pop()
    assert "1 rank [5]" in report and "bfloat16" in report, report


@pytest.mark.slow
def test_upstream_errors_pass_through_the_relay(relay: tuple[str, str, Path]) -> None:
    relay_addr, _, _ = relay
    m = manifest_of()
    result = run_rank(relay_addr, join_request("e", 9, 4, m), m, timeout=10)
    assert result.error is not None
    assert result.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank 9 is outside [0, 4)" in (result.error.details() or "")


@pytest.mark.slow
def test_a_rank_that_leaves_a_relayed_group_can_come_back(relay: tuple[str, str, Path]) -> None:
    relay_addr, coordinator, _ = relay
    m = manifest_of()
    channel = grpc.insecure_channel(relay_addr)
    gone = pb_grpc.CohortServiceStub(channel).Join(join_request("l", 1, 3, m), timeout=30)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(run_rank, relay_addr, join_request("l", 0, 3, m), m)
        time.sleep(0.5)  # both sent upstream as one group
        # Its first event: the manifest request if rank 1 reached the relay first (it then
        # dies without uploading and rank 0 is asked instead), else the progress.
        assert next(gone).WhichOneof("event") in ("manifest_request", "progress")
        gone.cancel()  # the relay re-joins rank 0 alone
        time.sleep(0.5)
        rest = [pool.submit(run_rank, relay_addr, join_request("l", r, 3, m), m) for r in (1, 2)]
        results = [first.result(), *(f.result() for f in rest)]
    channel.close()
    one_cohort(results, FORMED)
    assert coordinator


def _through(nodes: list[str], job: str, manifests: dict[int, Manifest]) -> list[RankResult]:
    """Ranks 0-1 through the first node relay, 2-3 through the second."""
    with ThreadPoolExecutor(len(manifests)) as pool:
        return list(
            pool.map(
                lambda r: run_rank(
                    nodes[r // 2], join_request(job, r, len(manifests), manifests[r]), manifests[r]
                ),
                sorted(manifests),
            )
        )


# Relays' audits go up once --local-ranks of them are in; the window (default 0.05 s) is
# long here so that a loaded machine never splits a step's batch in these tests.
AUDIT_WINDOW = ("--audit-window", "2")


@pytest.fixture
def rack(tmp_path: Path) -> Iterator[tuple[list[str], int, Path]]:
    """A coordinator, a rack relay (4 ranks) and two node relays (2 ranks each) under it:
    (the node relays' addresses, the rack relay's port, the coordinator's log)."""
    with coordinator_process(
        "--join-deadline", "30", "--log-level", "debug", "--progress-interval", "0.2", tmp=tmp_path
    ) as (addr, log):
        procs = []
        try:
            rack, rack_port = spawn(
                tmp_path / "rack-port",
                ["--upstream", addr, "--local-ranks", "4", "--window", "20", *POLL, *AUDIT_WINDOW],
                stdout=open(tmp_path / "rack.log", "wb"),  # noqa: SIM115 (closed with it)
                new_session=True,
                command="relay",
            )
            procs.append(rack)
            nodes = []
            for i in range(2):
                proc, port = spawn(
                    tmp_path / f"node{i}-port",
                    [
                        *("--upstream", f"127.0.0.1:{rack_port}", "--local-ranks", "2"),
                        *POLL,
                        *AUDIT_WINDOW,
                    ],
                    stdout=open(tmp_path / f"node{i}.log", "wb"),  # noqa: SIM115
                    new_session=True,
                    command="relay",
                )
                procs.append(proc)
                nodes.append(f"127.0.0.1:{port}")
            yield nodes, rack_port, log
        finally:
            for proc in procs:
                kill_group(proc)


@pytest.mark.slow
def test_relays_of_relays_join_a_rack_as_one_call(rack: tuple[list[str], int, Path]) -> None:
    """The coordinator sees one group of 4; every rank gets the verdict; a refusal's
    manifest requests and uploads cross both levels; a group the relay cannot take is
    refused naming why."""
    nodes, rack_port, log = rack
    m = manifest_of()
    bad = {r: manifest_of(dtype="bfloat16") if r == 3 else m for r in range(4)}
    for job, manifests, outcome in (
        ("rack", dict.fromkeys(range(4), m), FORMED),
        ("rack-refused", bad, REFUSED),
    ):
        results = _through(nodes, job, manifests)
        verdict = one_cohort(results, outcome)
    assert sum(r.manifest_requests for r in results) == 2  # one per class, 2 hops down
    report = verdict.refusal.report
    assert "1 rank [3]" in report and "bfloat16" in report, report
    assert joined_groups(log) == [4, 4, 4, 4, 4, 4, 4, 4], joined_groups(log)
    # The rack relay polls the coordinator (JoinPoll); it takes its node relays' groups on
    # JoinGroup streams, which they fall back to on its UNIMPLEMENTED (as against 0.2).
    fallback = "the upstream has no JoinPoll"
    assert fallback not in (log.parent / "rack.log").read_text()
    for i in range(2):
        assert fallback in (log.parent / f"node{i}.log").read_text()
    mixed = pb.JoinGroupRequest(members=[join_request("a", 0, 2, m), join_request("b", 1, 2, m)])
    with (
        grpc.insecure_channel(f"127.0.0.1:{rack_port}") as channel,
        pytest.raises(grpc.RpcError) as err,
    ):
        list(pb_grpc.CohortServiceStub(channel).JoinGroup(mixed, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "of 2 jobs" in (err.value.details() or ""), err.value.details()


def _coordinator_of(tmp: Path) -> tuple[str, str]:
    """The rack's coordinator: (its gRPC address, its metrics URL)."""
    (port_file,) = tmp.glob("port-*")
    grpc_port, metrics_port = port_file.read_text().split()[:2]
    return f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{metrics_port}"


@pytest.mark.slow
def test_audits_cross_a_rack_as_one_call_a_step_and_a_bad_one_is_its_ranks_error_only(
    rack: tuple[list[str], int, Path],
) -> None:
    """Node relays batch their ranks' audits, the rack relay its nodes': the coordinator
    gets one Audit call per step. A malformed audit (rank 1's) spoils its batch at the
    coordinator: the relays send each request again alone, so rank 1 alone is refused and
    its node's rank 0 and the other node are answered. The per-tensor digests the
    coordinator asks for cross both levels and the divergence is named."""
    nodes, _, log = rack
    addr, metrics_url = _coordinator_of(log.parent)
    v = one_cohort(_through(nodes, "rack-audit", dict.fromkeys(range(4), manifest_of())), FORMED)
    for step in range(3):
        answers = audit_step(lambda r: nodes[r // 2], {r: rank_audit(v, r, step) for r in range(4)})
        for answer in answers.values():
            assert isinstance(answer, pb.AuditReply), answer
            assert not answer.answers[0].report and not answer.answers[0].tensors_rank
    assert metric_total(metrics_url, "cohortgate_audits_total") == 12
    assert metric_total(metrics_url, "cohortgate_audit_calls_total") == 3  # one per step
    assert metric_total(metrics_url, "cohortgate_audited_steps_total") == 3

    # step 3: rank 3's weights changed; rank 1 sends a digest of 5 bytes
    step3 = {r: rank_audit(v, r, 3, odd=r == 3) for r in range(4)}
    answers = audit_step(
        lambda r: nodes[r // 2], {**step3, 1: rank_audit(v, 1, 3, digest=b"short")}
    )
    bad = answers.pop(1)
    assert isinstance(bad, grpc.RpcError), bad
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
    assert "digest" in (bad.details() or ""), bad.details()
    for rank, answer in answers.items():
        assert isinstance(answer, pb.AuditReply), (rank, answer)
        assert answer.answers[0].cohort_id == v.cohort_id
    # rank 1's step 3 completes the step: the coordinator asks ranks 0 and 3 for tensors
    (late,) = audit_step(lambda r: nodes[r // 2], {1: step3[1]}).values()
    assert isinstance(late, pb.AuditReply), late
    asked = sorted(zip(late.answers[0].tensors_rank, late.answers[0].tensors_step, strict=True))
    assert asked == [(0, 3), (3, 3)]
    sent = audit_step(
        lambda r: nodes[r // 2], {0: tensors_of(v, 0, 3), 3: tensors_of(v, 3, 3, odd="fc.bias")}
    )
    headline = "replicas diverged at step 3: rank 3 on host0 differs from ranks 0-2 in fc.bias"
    told = [a.answers[0].headline for a in sent.values() if isinstance(a, pb.AuditReply)]
    assert headline in told, sent
    with grpc.insecure_channel(addr) as ch:
        found = pb_grpc.StatusServiceStub(ch).ListAudits(pb.ListAuditsRequest(job_id="rack-audit"))
    assert [(r.kind, r.step, r.headline) for r in found.audits] == [("diverged", 3, headline)]


@pytest.mark.slow
def test_a_racks_batch_is_cut_at_the_coordinators_limit_on_audits_per_call(
    tmp_path: Path,
) -> None:
    """A rack relay of 2,048 ranks: two nodes' batches of 600 audits each (ranks that
    queued many steps while the coordinator was away) would make one call of 1,200, past
    the coordinator's limit (1,024), refused for every rank; the relay sends the first as
    soon as the second would pass it, and both are answered, none refused."""
    with coordinator_process("--join-deadline", "30", tmp=tmp_path) as (addr, _):
        relay, port = spawn(
            tmp_path / "rack-port",
            ["--upstream", addr, "--local-ranks", "2048", *AUDIT_WINDOW],
            stdout=open(tmp_path / "rack.log", "wb"),  # noqa: SIM115 (closed with it)
            new_session=True,
            command="relay",
        )
        try:
            _, metrics_url = _coordinator_of(tmp_path)
            m = manifest_of()
            v = one_cohort(run_cohort(addr, "rack-cap", dict.fromkeys(range(4), m)), FORMED)
            batches = [
                pb.AuditRequest(audits=[rank_audit(v, r, s) for s in steps for r in range(4)])
                for steps in (range(0, 150), range(150, 300))
            ]
            assert [len(b.audits) for b in batches] == [600, 600]
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, ThreadPoolExecutor(2) as pool:
                stub = pb_grpc.CohortServiceStub(ch)
                first = pool.submit(stub.Audit, batches[0], timeout=30)
                time.sleep(0.3)  # the first batch is held for the rack's other ranks
                second = pool.submit(stub.Audit, batches[1], timeout=30)
                replies = [first.result(), second.result()]
        finally:
            kill_group(relay)
        assert [r.answers[0].cohort_id for r in replies] == [v.cohort_id] * 2
        assert metric_total(metrics_url, "cohortgate_rpc_errors_total") == 0  # none refused
        assert metric_total(metrics_url, "cohortgate_audits_total") == 1200
        assert metric_total(metrics_url, "cohortgate_audit_calls_total") == 2
        assert metric_total(metrics_url, "cohortgate_audited_steps_total") == 300


@pytest.mark.slow
def test_a_rank_that_leaves_under_two_relays_lets_the_rest_form(
    rack: tuple[list[str], int, Path],
) -> None:
    """Rank 1 dies after its node relay sent it up with rank 0: the node relay re-joins rank 0
    alone, and the rack relay, still holding the group for ranks 2-3, takes the new call in
    the old one's place (not sending the old group up as if rank 0 were a restarted
    process); a restarted rank 1 and the other node's ranks then form one cohort with rank 0,
    joined upstream as one group of 4."""
    nodes, _, log = rack
    m = manifest_of()
    channel = grpc.insecure_channel(nodes[0])
    gone = pb_grpc.CohortServiceStub(channel).Join(join_request("leave", 1, 4, m), timeout=30)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(run_rank, nodes[0], join_request("leave", 0, 4, m), m)
        time.sleep(0.5)  # both sent up to the rack relay, which holds them for ranks 2-3
        gone.cancel()
        time.sleep(0.5)
        rest = [
            pool.submit(run_rank, nodes[r // 2], join_request("leave", r, 4, m), m)
            for r in (1, 2, 3)
        ]
        results = [first.result(), *(f.result() for f in rest)]
    channel.close()
    one_cohort(results, FORMED)
    assert joined_groups(log)[-4:] == [4, 4, 4, 4], joined_groups(log)


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_cohortgate_run_joins_through_a_relay(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "60", "--log-level", "debug", tmp=tmp_path) as (
        addr,
        log,
    ):
        proc = launch(
            [
                "--coordinator",
                addr,
                "--nproc-per-node",
                "4",
                "--master-port",
                "0",
                str(REPO / "examples" / "train.py"),
                "--steps",
                "2",
            ],
            {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "COHORTGATE_JOB": f"relayed-{uuid.uuid4().hex[:6]}",
            },
            tmp_path,
            via="cohortgate run",
        )
        try:
            out, _ = proc.communicate(timeout=180)
        finally:
            kill_group(proc)
        groups = joined_groups(log)
    assert proc.returncode == 0, out
    assert "[cohortgate] relay 127.0.0.1:" in out
    assert out.count("all_reduce sum 10, trained 2 steps") == 4, out
    assert len(groups) == 4 and max(groups) > 1, f"the coordinator saw groups {groups}"
