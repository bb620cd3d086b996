"""No hang, no wrong verdict: dead ranks, coordinator restarts, and chaos over many rounds."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.contract.manifest import Manifest
from tests.helpers import (
    REPO,
    InProcessCoordinator,
    free_port,
    join_request,
    manifest_of,
    run_cohort,
    run_rank,
    serving_pid,
)
from tests.launches import agent_rank, coordinator_process, freeze, kill_group


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigkill_while_16_ranks_wait_then_restart_forms_with_no_rank_failing(
    tmp_path: Path,
) -> None:
    listen = f"127.0.0.1:{free_port()}"
    ref, wide = manifest_of(4), manifest_of(8)
    with ThreadPoolExecutor(max_workers=17) as pool:
        with coordinator_process(tmp=tmp_path, listen=listen) as (addr, log):
            refused = run_cohort(addr, "before-kill", {0: ref, 1: wide})
            report = refused[0].verdict.refusal.report if refused[0].verdict else ""
            assert "differs" in report
            waiting = [pool.submit(agent_rank, addr, "restart-job", r, 17, ref) for r in range(16)]
            with grpc.insecure_channel(addr) as ch:
                status = pb_grpc.StatusServiceStub(ch)
                give_up = time.monotonic() + 30
                while True:
                    cohorts = status.ListCohorts(
                        pb.ListCohortsRequest(job_id="restart-job"), timeout=5
                    ).cohorts
                    if cohorts and cohorts[0].joined == 16:
                        break
                    assert time.monotonic() < give_up
                    time.sleep(0.05)
            os.kill(serving_pid(log), signal.SIGKILL)
        time.sleep(0.5)
        assert not any(f.done() for f in waiting), "no rank fails while the coordinator is gone"
        with coordinator_process(tmp=tmp_path, listen=listen) as (addr, _):
            last = pool.submit(agent_rank, addr, "restart-job", 16, 17, ref)
            verdicts = [f.result(timeout=60) for f in [*waiting, last]]
            with grpc.insecure_channel(addr) as ch:
                record = pb_grpc.StatusServiceStub(ch).GetVerdict(
                    pb.GetVerdictRequest(job_id="before-kill"), timeout=5
                )
    assert {v.outcome for v in verdicts} == {pb.Verdict.OUTCOME_FORMED}
    assert len({v.cohort_id for v in verdicts}) == 1
    assert record.outcome == "refused" and record.report == report


@pytest.mark.timeout(120)
def test_a_decided_rank_rejoining_after_restart_gets_the_same_verdict(tmp_path: Path) -> None:
    listen = f"127.0.0.1:{free_port()}"
    m = manifest_of()
    requests = [join_request("replayed", r, 2, m) for r in range(2)]
    from tests.helpers import run_rank

    with coordinator_process(tmp=tmp_path, listen=listen) as (addr, log):
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = [f.result() for f in [pool.submit(run_rank, addr, q, m) for q in requests]]
        os.kill(serving_pid(log), signal.SIGKILL)
    with coordinator_process(tmp=tmp_path, listen=listen) as (addr, _):
        again = run_rank(addr, requests[1], m)
    assert first[1].verdict is not None and again.verdict is not None
    assert again.verdict == first[1].verdict, "the same verdict, not a new round"


def _holds(c: InProcessCoordinator, job_id: str, rank: int) -> bool:
    cohort = c.running.coordinator.find(job_id)
    return cohort is not None and rank in cohort.state.members


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_that_dies_while_waiting_is_dropped_and_reported_missing(tmp_path: Path) -> None:
    c = InProcessCoordinator(join_deadline=4.0, rank_grace=2.0)
    script = (
        f"import sys, time; sys.path.insert(0, {str(REPO)!r});"
        "from tests.helpers import join_request, manifest_of, run_rank;"
        f"m = manifest_of(); run_rank({c.addr!r}, join_request('dying', 1, 3, m), m, 60)"
    )
    try:
        proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
        give_up = time.monotonic() + 20
        while not c.call(lambda: _holds(c, "dying", 1)):
            assert time.monotonic() < give_up, "the rank never joined"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # dies without a word
        killed_at = time.monotonic()
        while c.call(lambda: _holds(c, "dying", 1)):
            assert time.monotonic() - killed_at < 2.0, "not dropped within the grace"
            time.sleep(0.05)
        results = run_cohort(c.addr, "dying", {0: manifest_of(), 2: manifest_of()}, world=3)
    finally:
        kill_group(proc)
        c.stop()
    for r in results:
        assert r.verdict is not None and r.verdict.refusal.missing_ranks == "1"


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_frozen_rank_is_dropped_within_the_grace_and_its_restart_takes_the_rank() -> None:
    """SIGSTOP keeps the connection open (a hung host): only keepalive can find it."""
    c = InProcessCoordinator(join_deadline=60.0, rank_grace=2.0)
    m = manifest_of()
    script = (
        f"import sys; sys.path.insert(0, {str(REPO)!r});"
        "from tests.helpers import join_request, manifest_of, run_rank;"
        f"m = manifest_of(); run_rank({c.addr!r}, join_request('frozen', 1, 5, m), m, 60)"
    )
    pool = ThreadPoolExecutor(max_workers=4)
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        waiting = [
            pool.submit(run_rank, c.addr, join_request("frozen", r, 5, m), m, 60) for r in (0, 2, 3)
        ]
        give_up = time.monotonic() + 20
        while not c.call(lambda: _holds(c, "frozen", 1)):
            assert time.monotonic() < give_up, "the rank never joined"
            time.sleep(0.05)
        freeze(proc.pid)  # frozen: its connection stays open
        frozen_at = time.monotonic()
        while c.call(lambda: _holds(c, "frozen", 1)):
            assert time.monotonic() - frozen_at < 3.0, "a frozen rank outlived the grace"
            time.sleep(0.05)
        dropped_s = time.monotonic() - frozen_at
        restarted = pool.submit(run_rank, c.addr, join_request("frozen", 1, 5, m), m, 60)
        last = run_rank(c.addr, join_request("frozen", 4, 5, m), m, 60)
        results = [w.result(timeout=30) for w in waiting] + [restarted.result(timeout=30), last]
    finally:
        kill_group(proc)
        pool.shutdown(wait=False, cancel_futures=True)
        c.stop()
    print(f"frozen rank dropped after {dropped_s:.2f} s (grace 2 s)")
    assert all(
        r.verdict is not None and r.verdict.outcome == pb.Verdict.OUTCOME_FORMED for r in results
    ), [r.error for r in results]


# -- chaos ---------------------------------------------------------------------------------
@dataclass
class RankOutcome:
    verdict: pb.Verdict | None = None
    over: bool = False  # re-joined after its round was decided (it was killed after)
    waited_s: float = 0.0
    killed: int = 0
    errors: list[str] = field(default_factory=list)


class ChaosRank:
    """One rank's current process: a sync gRPC join, as the agent makes it, killable."""

    def __init__(self, stub: pb_grpc.CohortServiceStub, request: pb.JoinRequest, m: Manifest):
        self.stub, self.request, self.m = stub, request, m
        self.out = RankOutcome()
        self.call: grpc.Future | None = None
        self.dead = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> RankOutcome:
        start = time.monotonic()
        try:
            while not self.dead.is_set():
                try:
                    self._stream()
                    break
                except grpc.RpcError as exc:
                    code, details = exc.code(), exc.details() or ""
                    if self.dead.is_set():
                        break
                    # As the agent does: the dead predecessor may not be dropped yet.
                    if code == grpc.StatusCode.ALREADY_EXISTS and time.monotonic() - start < 5:
                        time.sleep(0.02)
                        continue
                    if code == grpc.StatusCode.FAILED_PRECONDITION and "is over" in details:
                        self.out.over = True
                    else:
                        self.out.errors.append(f"{code.name}: {details}")
                    break
        finally:
            self.out.waited_s = time.monotonic() - start
        return self.out

    def _stream(self) -> None:
        call = self.stub.Join(self.request, timeout=30)
        with self.lock:
            self.call = call
            if self.dead.is_set():
                call.cancel()
        for event in call:
            kind = event.WhichOneof("event")
            if kind == "manifest_request":
                self.stub.UploadManifest(
                    wire.manifest_answer(self.request, event.manifest_request.round, self.m),
                    timeout=30,
                )
            elif kind == "verdict":
                self.out.verdict = event.verdict

    def kill(self) -> bool:
        """The process dies: its call drops mid-join. False if it had already finished."""
        with self.lock:
            if self.out.verdict is not None or self.out.over or self.out.errors:
                return False
            self.dead.set()
            if self.call is not None:
                self.call.cancel()
        return True


def chaos_round(
    stubs: list[pb_grpc.CohortServiceStub], job: str, world: int, m: Manifest, rng: random.Random
) -> dict[int, RankOutcome]:
    delays = [rng.uniform(0, 0.05) for _ in range(world)]
    victims = {
        v: (rng.uniform(0, 0.1), rng.uniform(0, 0.05))
        for v in rng.sample(range(world), rng.randint(0, 4))
    }
    final: dict[int, RankOutcome] = {}
    killed = dict.fromkeys(range(world), 0)

    def life(rank: int) -> None:
        time.sleep(delays[rank])
        current = ChaosRank(stubs[rank % len(stubs)], join_request(job, rank, world, m), m)
        if rank in victims:
            kill_after, restart_after = victims[rank]
            runner = threading.Thread(target=current.run)
            runner.start()
            time.sleep(kill_after)
            if current.kill():
                killed[rank] += 1
                runner.join()
                time.sleep(restart_after)
                # A restarted process re-joins the round it knew; if over, it is told so.
                current = ChaosRank(
                    stubs[rank % len(stubs)], join_request(job, rank, world, m, round=1), m
                )
                current.run()
            else:
                runner.join()
        else:
            current.run()
        current.out.killed = killed[rank]
        final[rank] = current.out

    threads = [threading.Thread(target=life, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return final


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chaos_200_rounds_of_32_ranks(tmp_path: Path) -> None:
    deadline = 5.0
    world, rounds, parallel = 32, 200, 2
    rng = random.Random(20261202)
    m = manifest_of()
    flags = ("--join-deadline", str(deadline), "--job-retention", "1")
    with coordinator_process(*flags, tmp=tmp_path) as (addr, log):
        pid: int | None = serving_pid(log)

        def run_all() -> tuple[list[dict[int, RankOutcome]], list[int]]:
            channels = [grpc.insecure_channel(addr) for _ in range(4)]
            stubs = [pb_grpc.CohortServiceStub(ch) for ch in channels]
            results: list[dict[int, RankOutcome]] = []
            samples: list[int] = []
            try:
                with ThreadPoolExecutor(max_workers=parallel) as pool:
                    for batch in range(rounds // parallel):
                        jobs = [f"chaos-{batch}-{i}" for i in range(parallel)]
                        seeds = [rng.random() for _ in jobs]
                        results += list(
                            pool.map(
                                lambda js: chaos_round(
                                    stubs, js[0], world, m, random.Random(js[1])
                                ),
                                zip(jobs, seeds, strict=True),
                            )
                        )
                        if pid is not None and batch % 10 == 9:
                            samples.append(rss_kib(pid))
            finally:
                for ch in channels:
                    ch.close()
            return results, samples

        try:
            results, samples = run_all()
        finally:
            if os.environ.get("COHORTGATE_KEEP_LOG"):
                import shutil

                shutil.copy(log, os.environ["COHORTGATE_KEEP_LOG"])
    assert len(results) == rounds
    killed = 0
    for number, outcomes in enumerate(results):
        errors = [e for o in outcomes.values() for e in o.errors]
        assert not errors, f"round {number}: {errors}"
        verdicts = {
            (o.verdict.cohort_id, o.verdict.outcome)
            for o in outcomes.values()
            if o.verdict is not None
        }
        assert len(verdicts) == 1, f"round {number}: survivors disagree: {verdicts}"
        ((_, outcome),) = verdicts
        assert outcome == pb.Verdict.OUTCOME_FORMED, f"round {number}"
        for rank, o in outcomes.items():
            assert o.verdict is not None or (o.over and o.killed), f"round {number} rank {rank}"
            assert o.waited_s <= deadline + 2, f"round {number} rank {rank} waited {o.waited_s}"
        killed += sum(o.killed for o in outcomes.values())
    assert killed > 100, "the chaos must actually kill ranks"
    # Memory: after warm-up, no growth across rounds beyond allocator noise.
    assert pid is not None and len(samples) >= 8
    warm, end = samples[2], samples[-1]
    print(f"coordinator RSS KiB by 20 rounds: {samples}; ranks killed: {killed}")
    assert end - warm < 8 * 1024, f"RSS grew {end - warm} KiB from round 60 to 200"


@pytest.mark.slow
def test_an_agent_that_never_reaches_the_coordinator_names_its_address() -> None:
    from cohortgate.agent.torchrun import CohortgateError

    addr = f"127.0.0.1:{free_port()}"  # nothing listens here
    started = time.monotonic()
    with pytest.raises(CohortgateError) as err:
        agent_rank(addr, "lonely", 0, 1, manifest_of(), timeout_s=2)
    text = str(err.value)
    assert f"cannot reach the cohortgate coordinator at {addr}: connection refused" in text
    assert "giving up after 2s" in text and "COHORTGATE_ADDR" in text
    assert "DEADLINE_EXCEEDED" not in text
    assert time.monotonic() - started < 10
