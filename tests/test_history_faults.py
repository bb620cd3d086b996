"""History is a record, never a gate: a locked, full or read-only history file changes no
verdict, is counted and shows in health, and the coordinator keeps serving."""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.state.history import HistoryError
from tests.helpers import (
    InProcessCoordinator,
    join_request,
    manifest_of,
    one_cohort,
    run_cohort,
    run_rank,
    serving_pid,
)
from tests.launches import coordinator_process

pytestmark = pytest.mark.timeout(120)
COHORTS = 20


def _health(addr: str, service: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


def _twenty_cohorts(addr: str, job: str) -> None:
    """Every rank of every cohort gets the same verdict: formed, with the same cohort id."""
    m = manifest_of()
    for i in range(COHORTS):
        results = run_cohort(addr, f"{job}-{i}", {0: m, 1: m})
        ids = {r.verdict.cohort_id for r in results if r.verdict is not None}
        assert len(ids) == 1, [r.error for r in results]
        assert all(
            r.verdict is not None and r.verdict.outcome == pb.Verdict.OUTCOME_FORMED
            for r in results
        ), [r.error for r in results]


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def _wait_for(check: object, what: str, within: float = 10.0) -> None:
    give_up = time.monotonic() + within
    while not check():  # type: ignore[operator]
        assert time.monotonic() < give_up, what
        time.sleep(0.1)


@pytest.mark.slow
def test_a_locked_history_changes_no_verdict_and_is_written_once_released(
    tmp_path: Path,
) -> None:
    path = tmp_path / "history.sqlite"
    c = InProcessCoordinator(history=str(path), join_deadline=30.0, progress_interval=0.2)
    locker = sqlite3.connect(path, isolation_level=None)
    try:
        locker.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
        started = time.monotonic()
        _twenty_cohorts(c.addr, "locked")
        took = time.monotonic() - started
        _wait_for(
            lambda: _metric(c.metrics_url, "cohortgate_history_errors_total") >= 1,
            "no history error was counted",
        )
        errors = _metric(c.metrics_url, "cohortgate_history_errors_total")
        _wait_for(lambda: _health(c.addr, "cohortgate.history") == 2, "health never said it")
        assert _health(c.addr, "") == health_pb2.HealthCheckResponse.SERVING
        with urllib.request.urlopen(c.metrics_url + "/healthz", timeout=10) as reply:
            assert reply.read().decode().startswith("degraded: history: database is locked")
        assert _metric(c.metrics_url, "cohortgate_history_degraded") == 1
        locker.execute("ROLLBACK")
        history = c.running.coordinator.history
        _wait_for(lambda: history.spooled == 0, "the spooled verdicts were never written", 40)
        _wait_for(lambda: _health(c.addr, "cohortgate.history") == 1, "health never recovered")
        assert history.flush(10), "gated, but their rows were never filed"
        stored = locker.execute("SELECT COUNT(*) FROM verdicts").fetchone()[0]
    finally:
        locker.close()
        c.stop()
    print(f"{COHORTS} cohorts formed in {took:.2f}s with the history locked, {errors:.0f} errors")
    assert stored == COHORTS
    assert took < 20, "a locked history must not stall the loop 5 s per verdict"


def test_a_verdict_reaches_the_ranks_only_once_the_history_holds_it(tmp_path: Path) -> None:
    """Stored, then sent: a rank whose call breaks as the coordinator dies must find the
    verdict in its successor's history. The file is locked for a moment as each of two
    cohorts is decided, one after the other; the ranks get each verdict only once it is
    committed, not before (a verdict stored does not let the next go unstored)."""
    path = tmp_path / "history.sqlite"
    c = InProcessCoordinator(history=str(path), join_deadline=30.0)
    locker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    m = manifest_of()
    try:
        for job in ("stored-first", "stored-next"):
            locker.execute("BEGIN EXCLUSIVE")
            release = threading.Timer(0.5, lambda: locker.execute("ROLLBACK"))
            release.start()
            results = run_cohort(c.addr, job, {0: m, 1: m})
            # Read at once (WAL: reads go on under the lock). A verdict sent before the
            # commit finds nothing stored, with the lock still held.
            with contextlib.closing(sqlite3.connect(path)) as reader:
                stored = _stored_rows(reader, job)
            release.join()
            assert all(r.verdict is not None for r in results), [r.error for r in results]
            assert stored == 1, f"{job}: the ranks got a verdict the history did not hold yet"
    finally:
        locker.close()
        c.stop()


def _stored_rows(db: sqlite3.Connection, job: str) -> int:
    """The job's verdicts the file holds: its gates (what delivery waits for) and the rows
    they become after delivery."""
    return sum(
        db.execute(f"SELECT COUNT(*) FROM {table} WHERE job_id = ?", (job,)).fetchone()[0]
        for table in _TABLES
    )


def _namespaced(before: str, after: str) -> object:
    """Run the coordinator in a mount namespace with its history on a small tmpfs; `before`
    runs once the history file exists, `after` once the coordinator serves."""

    def wrap(command: list[str], port_file: Path) -> list[str]:
        directory = port_file.parent / "histfs"
        directory.mkdir()
        create = (
            f"{sys.executable} -c 'import sys; from cohortgate.coordinator.state.history import "
        )
        create += 'History; History(sys.argv[1]).close()\' "$D/history.sqlite"'
        script = (
            f'set -e; mount -t tmpfs -o size=1m tmpfs "$D"; {create}; {before}; "$@" & pid=$!; '
            f'while [ ! -s "$P" ]; do sleep 0.05; done; {after}; wait "$pid"'
        )
        return [
            "env",
            f"D={directory}",
            f"P={port_file}",
            "unshare",
            "-rm",
            "sh",
            "-c",
            script,
            "sh",
            *command,
            "--history",
            str(directory / "history.sqlite"),
        ]

    return wrap


@pytest.mark.parametrize(
    ("before", "after"),
    [
        pytest.param("true", 'dd if=/dev/zero of="$D/fill" bs=4k 2>/dev/null || true', id="full"),
        pytest.param('mount -o remount,ro "$D"', "true", id="read-only"),
    ],
)
@pytest.mark.slow
def test_a_full_or_read_only_history_filesystem_changes_no_verdict(
    tmp_path: Path, before: str, after: str
) -> None:
    wrap = _namespaced(before, after)
    with coordinator_process(tmp=tmp_path, wrap=wrap) as (addr, log):  # type: ignore[arg-type]
        _twenty_cohorts(addr, "broken-fs")
        _wait_for(lambda: _health(addr, "cohortgate.history") == 2, "health never said it")
        assert _health(addr, "") == health_pb2.HealthCheckResponse.SERVING
        port = int(
            (log.parent / next(p.name for p in log.parent.glob("port-*"))).read_text().split()[1]
        )
        assert _metric(f"http://127.0.0.1:{port}", "cohortgate_history_errors_total") >= 1
    assert "history write failed" in log.read_text()


def test_a_corrupt_history_file_stops_the_start_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "history.sqlite"
    bad.write_bytes(b"this is not a database, it is a text file" * 100)
    with pytest.raises(HistoryError) as err:
        from cohortgate.coordinator.state.history import History

        History(bad)
    assert str(err.value).startswith(f"--history {bad}: cannot use the verdict history")
    assert "move the file aside" in str(err.value)


def test_a_coordinator_killed_between_its_two_writes_replays_from_the_gate(
    tmp_path: Path,
) -> None:
    """The gate that delivery waits for is written, the listing row never is (a trigger in
    the file refuses it), the coordinator is SIGKILLed: its successor replays the same
    verdict to a re-joining rank, lists it, and files the row once the file takes it."""
    path = tmp_path / "history.sqlite"

    def tables() -> list[int]:
        with contextlib.closing(sqlite3.connect(path)) as db:
            return [db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in _TABLES]

    with coordinator_process(tmp=tmp_path):
        pass  # creates the file and its schema
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute(
            "CREATE TRIGGER hold_rows BEFORE INSERT ON verdicts "
            "BEGIN SELECT RAISE(ABORT, 'test: the second write never lands'); END"
        )
        db.commit()
    m, wide = manifest_of(), manifest_of(width=8)
    requests = {r: join_request("halfway", r, 2, x) for r, x in ((0, m), (1, wide))}
    with coordinator_process(tmp=tmp_path) as (addr, log), ThreadPoolExecutor(2) as pool:
        ranks = [
            pool.submit(run_rank, addr, q, manifest)
            for q, manifest in ((requests[0], m), (requests[1], wide))
        ]
        verdict = ranks[0].result(timeout=30).verdict
        assert verdict is not None and verdict.outcome == pb.Verdict.OUTCOME_REFUSED
        assert ranks[1].result(timeout=30).verdict == verdict
        os.kill(serving_pid(log), signal.SIGKILL)
    assert tables() == [1, 0], "killed between the writes: a gate and no row"
    with coordinator_process(tmp=tmp_path) as (addr, _):  # the trigger still refuses rows
        again = run_rank(addr, requests[0], m)
        with grpc.insecure_channel(addr) as channel:
            listed = pb_grpc.StatusServiceStub(channel).GetVerdict(
                pb.GetVerdictRequest(job_id="halfway"), timeout=10
            )
    assert again.verdict is not None
    assert (again.verdict.outcome, again.verdict.cohort_id, again.verdict.refusal.report) == (
        verdict.outcome,
        verdict.cohort_id,
        verdict.refusal.report,
    )
    assert again.verdict == verdict, "replayed whole, as the ranks received it"
    assert (listed.cohort_id, listed.report) == (verdict.cohort_id, verdict.refusal.report)
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute("DROP TRIGGER hold_rows")
        db.commit()
    with coordinator_process(tmp=tmp_path):
        pass  # opening the file files the gate
    assert tables() == [0, 1]


_TABLES = ("gates", "verdicts")


def test_a_poll_that_comes_back_to_its_decided_round_gets_the_verdict_once_stored(
    tmp_path: Path,
) -> None:
    """A relay's next JoinPoll after its round was decided takes the decided round's path
    (a re-join), not the waiting calls': it too is answered only once the history holds the
    verdict. The file is locked as the cohort is decided."""
    path = tmp_path / "history.sqlite"
    c = InProcessCoordinator(history=str(path), join_deadline=30.0)
    locker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    # Under RECORD_WAIT_S (1 s): past it, a verdict goes out unstored.
    release = threading.Timer(0.6, lambda: locker.execute("ROLLBACK"))
    m = manifest_of()
    members = [join_request("back", 0, 2, m)]
    try:
        with grpc.insecure_channel(c.addr) as channel, ThreadPoolExecutor(1) as pool:
            stub = pb_grpc.CohortServiceStub(channel)
            first = stub.JoinPoll(pb.JoinGroupRequest(members=members), timeout=30)
            assert first.WhichOneof("event") == "manifest_request", first
            stub.UploadManifest(wire.manifest_answer(members[0], first.manifest_request.round, m))
            locker.execute("BEGIN EXCLUSIVE")
            release.start()
            other = pool.submit(run_rank, c.addr, join_request("back", 1, 2, m), m)
            give_up = time.monotonic() + 10
            while c.call(lambda: c.running.coordinator.summaries("back"))[-1].state == "waiting":
                assert time.monotonic() < give_up, "never decided"
                time.sleep(0.01)
            assert release.is_alive(), "decided after the lock was released: no race left"
            again = stub.JoinPoll(pb.JoinGroupRequest(members=members), timeout=30)
            with contextlib.closing(sqlite3.connect(path)) as reader:
                stored = _stored_rows(reader, "back")
            assert again.verdict.outcome == pb.Verdict.OUTCOME_FORMED, again
            assert stored == 1, "the poll got a verdict the history did not hold yet"
            assert other.result(timeout=30).verdict == again.verdict
        calls = c.running.coordinator.calls
        # the answered polls' members linger for the relay's next poll, then leave
        _wait_for(
            lambda: c.call(lambda: (calls._held, calls._cohorts)) == ({}, {}),
            "a call kept once every poll was answered and its linger over",
        )
    finally:
        release.cancel()
        locker.close()
        c.stop()


def test_once_a_verdict_went_out_unstored_the_next_is_not_held_for_the_history(
    tmp_path: Path,
) -> None:
    """A history that stalls before it fails (its file locked by another process: a write
    waits WRITE_BUSY_S, 2 s, before it errs): the first verdict is held RECORD_WAIT_S (1 s),
    then sent, and that is said once, whole; the next, decided while the history is still
    late, is sent without being held (said nothing)."""
    path = tmp_path / "history.sqlite"
    c = InProcessCoordinator(history=str(path), join_deadline=30.0)
    locker = sqlite3.connect(path, isolation_level=None)
    m = manifest_of()
    try:
        locker.execute("BEGIN EXCLUSIVE")
        with structlog.testing.capture_logs() as logs:
            for job in ("late-a", "late-b"):
                one_cohort(run_cohort(c.addr, job, {0: m}), pb.Verdict.OUTCOME_FORMED)
            time.sleep(1.5)  # past the second verdict's RECORD_WAIT_S, had it been held
    finally:
        locker.close()
        c.stop()
    late = [e for e in logs if e["event"] == "verdict sent before the history stored it"]
    assert late == [
        {
            "event": "verdict sent before the history stored it",
            "log_level": "warning",
            "job": "late-a",
            "round": 1,
            "waited_s": 1.0,
            "advice": "the history file is slow or refuses writes; the record is retried",
        }
    ]


@pytest.mark.parametrize("history", ["off", "file"])
def test_a_healthy_history_holds_no_verdict_back(tmp_path: Path, history: str) -> None:
    """A history that stores at once (`--history off`: this process's memory, stored
    before `record` returns; or a file nobody else holds) never holds a verdict back for
    RECORD_WAIT_S: no "sent before the history stored it", formed or refused."""
    where = "off" if history == "off" else str(tmp_path / "history.sqlite")
    c = InProcessCoordinator(history=where, join_deadline=30.0)
    m = manifest_of()
    try:
        with structlog.testing.capture_logs() as logs:
            one_cohort(run_cohort(c.addr, "ok", {0: m, 1: m}), pb.Verdict.OUTCOME_FORMED)
            one_cohort(
                run_cohort(c.addr, "no", {0: m, 1: manifest_of(dtype="bfloat16")}),
                pb.Verdict.OUTCOME_REFUSED,
            )
    finally:
        c.stop()
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == []
