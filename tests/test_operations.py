"""What on-call sees: health, reflection, the status API, logs, history, the CLI (the status
page, Prometheus, the dashboard and the alerts are tests/test_dashboards.py's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from tests.helpers import (
    InProcessCoordinator,
    finish_cohort,
    free_port,
    hold_partial_cohort,
    http_get,
    join_request,
    log_events,
    manifest_of,
    run_cohort,
    run_rank,
    serving_pid,
    wait_joined,
)
from tests.launches import agent_rank, coordinator_process

CLI = [sys.executable, "-m", "cohortgate.coordinator.cli"]


# -- gRPC health and reflection ---------------------------------------------------------
def test_health_overall_and_per_service(coord: InProcessCoordinator) -> None:
    with grpc.insecure_channel(coord.addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "cohortgate.v1.CohortService", "cohortgate.v1.StatusService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_client_lists_services_and_calls_status(coord: InProcessCoordinator) -> None:
    pool = hold_partial_cohort(coord, "reflected", [0], 2)
    try:
        with grpc.insecure_channel(coord.addr) as channel:
            db = ProtoReflectionDescriptorDatabase(channel)
            services = set(db.get_services())
            assert {
                "cohortgate.v1.CohortService",
                "cohortgate.v1.StatusService",
                "grpc.health.v1.Health",
            } <= services
            # No generated stubs: the request and reply types come from the server.
            dpool = descriptor_pool.DescriptorPool(db)
            method = dpool.FindServiceByName("cohortgate.v1.StatusService").FindMethodByName(
                "ListCohorts"
            )
            request_cls = message_factory.GetMessageClass(method.input_type)
            reply_cls = message_factory.GetMessageClass(method.output_type)
            call = channel.unary_unary(
                "/cohortgate.v1.StatusService/ListCohorts",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=reply_cls.FromString,
            )
            reply: Any = call(request_cls(job_id="reflected"), timeout=5)
            (cohort,) = reply.cohorts
            assert (cohort.job_id, cohort.joined, cohort.expected) == ("reflected", 1, 2)
            assert cohort.missing_ranks == "1"
    finally:
        finish_cohort(coord, "reflected", [1], 2)
        pool.shutdown(wait=True)


# -- status API -----------------------------------------------------------------------
def test_status_list_detail_and_watch(coord: InProcessCoordinator) -> None:
    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
    from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc

    pool = hold_partial_cohort(coord, "watched", [0, 2], 4)
    with grpc.insecure_channel(coord.addr) as channel:
        stub = pb_grpc.StatusServiceStub(channel)
        (summary,) = stub.ListCohorts(pb.ListCohortsRequest(job_id="watched"), timeout=5).cohorts
        assert summary.state == pb.COHORT_STATE_WAITING
        assert summary.missing_ranks == "1,3" and summary.deadline_in_seconds > 0
        detail = stub.GetCohort(pb.GetCohortRequest(job_id="watched"), timeout=5)
        assert [(r.rank, r.host) for r in detail.ranks] == [(0, "host0"), (2, "host0")]
        assert all(r.incarnation and r.last_seen_unix > 0 for r in detail.ranks)
        watch = stub.WatchCohorts(pb.WatchCohortsRequest(job_id="watched"), timeout=20)
        first = next(watch)
        assert first.joined == 2
        finish_cohort(coord, "watched", [1, 3], 4)
        states = []
        for change in watch:
            states.append(change.state)
            if change.state != pb.COHORT_STATE_WAITING:
                break
        watch.cancel()
        assert states[-1] == pb.COHORT_STATE_FORMED
        with pytest.raises(grpc.RpcError) as err:
            stub.GetCohort(pb.GetCohortRequest(job_id="nope"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    pool.shutdown(wait=True)


# -- logs, history, CLI, shutdown -------------------------------------------------------
def _cli(*args: str, addr: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args, "--addr", addr], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_history_survives_kill_9_and_explain_shows_the_refusal(tmp_path: Path) -> None:
    ref, wide = manifest_of(4), manifest_of(8)
    with coordinator_process(tmp=tmp_path) as (addr, log):
        results = run_cohort(addr, "hist-job", {0: ref, 1: ref, 2: wide})
        report = results[0].verdict.refusal.report if results[0].verdict else ""
        assert report
        # kill -9: no graceful shutdown, no flush on exit
        pid = serving_pid(log)
        os.kill(pid, signal.SIGKILL)
    with coordinator_process(tmp=tmp_path) as (addr, _):
        out = _cli("explain", "hist-job", addr=addr)
        assert out.returncode == 0, out.stderr
        assert "job hist-job round 1: refused" in out.stdout
        assert report in out.stdout
        as_json = json.loads(_cli("explain", "hist-job", "1", "--json", addr=addr).stdout)
        assert as_json["outcome"] == "refused" and as_json["cause"] == "signature_mismatch"
        # rounds continue after the restart, so history keys never collide
        again = run_cohort(addr, "hist-job", {0: ref, 1: ref, 2: ref})
        assert again[0].verdict is not None and again[0].verdict.round == 2
        missing = _cli("explain", "never-ran", addr=addr)
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_logs_are_json_one_line_per_decision_reason_only_on_change(tmp_path: Path) -> None:
    m = manifest_of()
    with coordinator_process(tmp=tmp_path) as (addr, log):
        with ThreadPoolExecutor(max_workers=4) as pool:
            futures = [
                pool.submit(run_rank, addr, join_request("logged", r, 4, m), m) for r in range(4)
            ]
            [f.result(timeout=30) for f in futures]
        time.sleep(0.2)
        events = log_events(log)
    mine = [e for e in events if e.get("job") == "logged"]
    decisions = [e for e in mine if e["event"] in ("cohort formed", "cohort refused")]
    assert len(decisions) == 1
    assert decisions[0]["reason"] == "[4/4 ranks joined, 1 signature]"
    assert decisions[0]["round"] == 1 and "timestamp" in decisions[0]
    waiting = [e["reason"] for e in mine if e["event"] == "waiting"]
    assert len(waiting) == len(set(waiting)), "a waiting reason is logged only when it changes"


def test_watches_are_capped_and_a_change_wakes_only_its_jobs_watchers() -> None:
    c = InProcessCoordinator(max_watchers_per_token=3, join_deadline=30.0, progress_interval=0.2)
    m = manifest_of()
    try:
        with grpc.insecure_channel(c.addr) as channel:
            stub = pb_grpc.StatusServiceStub(channel)
            run_cohort(c.addr, "job-a", {0: m})  # so that each watch starts with one summary
            watches = [
                stub.WatchCohorts(pb.WatchCohortsRequest(job_id="job-a"), timeout=20)
                for _ in range(3)
            ]
            for watch in watches:
                next(watch)
            with pytest.raises(grpc.RpcError) as err:
                next(stub.WatchCohorts(pb.WatchCohortsRequest(job_id="job-a"), timeout=5))
            run_cohort(c.addr, "job-b", {0: m, 1: m})
            hub = c.running.coordinator.watchers
            woken = c.call(lambda: sum(len(w.outbox) for w in hub._by_job["job-a"]))
            run_cohort(c.addr, "job-a", {0: m}, launch="2")  # round 2: what each watch sees
            seen = [next(watch).job_id for watch in watches]
            for watch in watches:
                watch.cancel()
    finally:
        c.stop()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_watchers_per_token=3" in (err.value.details() or "")
    assert woken == 0
    assert seen == ["job-a"] * 3, "job B's changes reached job A's watchers"


def test_a_watcher_gets_at_most_one_update_per_job_per_watch_interval() -> None:
    """12 ranks join 0.1 s apart: a watcher sees the cohort's latest state once per
    interval, not every join (which made 100 watchers slow every formation 9x)."""
    interval = 0.5
    c = InProcessCoordinator(join_deadline=30.0, watch_interval=interval)
    m = manifest_of()
    try:
        with grpc.insecure_channel(c.addr) as channel:
            watch = pb_grpc.StatusServiceStub(channel).WatchCohorts(
                pb.WatchCohortsRequest(job_id="paced"), timeout=30
            )
            seen: list[pb.CohortSummary] = []
            with ThreadPoolExecutor(max_workers=13) as pool:
                reader = pool.submit(seen.extend, watch)
                start = time.monotonic()
                ranks = []
                for r in range(12):
                    ranks.append(
                        pool.submit(run_rank, c.addr, join_request("paced", r, 12, m), m, 30)
                    )
                    time.sleep(0.1)
                assert all(f.result(timeout=30).verdict for f in ranks)
                while not any(s.state == pb.COHORT_STATE_FORMED for s in seen):
                    assert time.monotonic() - start < 20, seen
                    time.sleep(0.05)
                took = time.monotonic() - start
                watch.cancel()
                reader.exception(timeout=10)
    finally:
        c.stop()
    joined = [s.joined for s in seen]
    assert len(seen) <= took / interval + 2, f"{len(seen)} updates in {took:.1f} s: {joined}"
    assert joined == sorted(joined) and seen[-1].state == pb.COHORT_STATE_FORMED


@pytest.mark.slow
def test_status_and_watch_cli(coord: InProcessCoordinator) -> None:
    pool = hold_partial_cohort(coord, "cli-job", [0, 1], 3)
    try:
        out = _cli("status", "--json", addr=coord.addr)
        assert out.returncode == 0, out.stderr
        (row,) = [c for c in json.loads(out.stdout) if c["job_id"] == "cli-job"]
        assert row["state"] == "COHORT_STATE_WAITING" and row["missing_ranks"] == "2"
        table = _cli("status", "cli-job", addr=coord.addr).stdout
        assert "cli-job" in table and "missing 2" in table
        watcher = subprocess.Popen(
            [*CLI, "watch", "cli-job", "--addr", coord.addr],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        # The watcher's first line, before the cohort completes (however long the CLI
        # takes to start on a busy machine).
        assert watcher.stdout is not None
        first = watcher.stdout.readline()
        finish_cohort(coord, "cli-job", [2], 3)
        rest, _ = watcher.communicate(timeout=30)
    finally:
        pool.shutdown(wait=True)
    out_text = first + rest
    assert watcher.returncode == 0, out_text
    assert "2/3 waiting, waiting for ranks 2" in first, out_text
    assert "verdict: formed [3/3 ranks joined, 1 signature]" in out_text


def test_cli_without_a_coordinator_says_where_it_looked() -> None:
    out = _cli("status", addr=f"127.0.0.1:{free_port()}", timeout=60)
    assert out.returncode == 1
    assert "no coordinator answers at 127.0.0.1:" in out.stderr
    assert "COHORTGATE_ADDR" in out.stderr


@pytest.mark.slow
def test_every_command_has_help() -> None:
    for command in ([], ["serve"], ["status"], ["watch"], ["explain"], ["run"]):
        out = subprocess.run([*CLI, *command, "--help"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, (command, out.stderr)
        assert "usage: cohortgate" in out.stdout


def test_sigterm_ends_waiting_joins_with_unavailable(tmp_path: Path) -> None:
    m = manifest_of()
    with (
        coordinator_process(tmp=tmp_path) as (addr, log),
        ThreadPoolExecutor(max_workers=1) as pool,
    ):
        waiting = pool.submit(run_rank, addr, join_request("shut", 0, 2, m), m)
        wait_joined(addr, "shut", 1)
        pid = serving_pid(log)
        os.kill(pid, signal.SIGTERM)
        result = waiting.result(timeout=30)
    assert result.error is not None
    assert result.error.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (result.error.details() or "")


@pytest.mark.slow
def test_agents_retry_against_a_restarted_coordinator(tmp_path: Path) -> None:
    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb

    port = free_port()
    listen = f"127.0.0.1:{port}"
    m = manifest_of()

    def rank(r: int) -> pb.Verdict:
        return agent_rank(listen, "restarted", r, 2, m)

    with ThreadPoolExecutor(max_workers=2) as pool:
        with coordinator_process(tmp=tmp_path, listen=listen) as (_, log):
            first = pool.submit(rank, 0)
            time.sleep(0.8)
            pid = serving_pid(log)
            os.kill(pid, signal.SIGTERM)  # rank 0 is told UNAVAILABLE and starts retrying
            time.sleep(1.0)
        assert not first.done()
        with coordinator_process(tmp=tmp_path, listen=listen):
            second = pool.submit(rank, 1)
            verdicts = [first.result(timeout=30), second.result(timeout=30)]
    assert all(v.outcome == pb.Verdict.OUTCOME_FORMED for v in verdicts)
    assert verdicts[0].cohort_id == verdicts[1].cohort_id


def test_a_waiting_cohorts_status_says_when_its_decision_can_next_change() -> None:
    """The decision's recheck time: the join deadline while ranks are missing, the upload
    timeout once every rank is in and the manifests that explain a mismatch are awaited."""
    coord = InProcessCoordinator(join_deadline=60.0, manifest_timeout=5.0)
    try:
        with grpc.insecure_channel(coord.addr) as channel:
            stub = pb_grpc.CohortServiceStub(channel)

            def waiting() -> dict[str, Any]:
                status = json.loads(http_get(coord.metrics_url + "/status.json"))
                (cohort,) = [c for c in status["waiting"] if c["job_id"] == "recheck"]
                return cast(dict[str, Any], cohort)

            first = stub.Join(join_request("recheck", 0, 2, manifest_of(4)), timeout=30)
            assert next(first).WhichOneof("event") == "manifest_request"  # ignored
            one = waiting()
            assert 55 < one["recheck_in_s"] <= 60 and 55 < one["deadline_in_s"] <= 60
            second = stub.Join(join_request("recheck", 1, 2, manifest_of(8)), timeout=30)
            assert next(second).WhichOneof("event") == "manifest_request"  # ignored too
            both = waiting()
            assert both["joined"] == 2 and 0 < both["recheck_in_s"] <= 5, both
            assert both["deadline_in_s"] > 50, "the join deadline no longer applies"
            first.cancel()
            second.cancel()
    finally:
        coord.stop()
