"""The restart race: a rank's process dies as its cohort completes and comes straight back as
a new incarnation. Every rank of the round must end with one outcome, the same for all."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.contract.errors import AlreadyHeld
from cohortgate.coordinator.decision.cohort import Member
from cohortgate.coordinator.decision.verdict import Outcome, Verdict
from cohortgate.coordinator.service.core import Coordinator
from cohortgate.coordinator.service.events import UploadAsk
from cohortgate.coordinator.state.base import JoinIntent
from tests.helpers import (
    InProcessCoordinator,
    decide_in,
    join_request,
    manifest_of,
    run_async,
    run_rank,
)
from tests.restarts import Load, run_load
from tests.test_relay_faults import relay_process

M = manifest_of()
LAUNCH = "node0:29500"


def member(rank: int, restart_count: int = 0) -> Member:
    return Member(
        rank=rank,
        host=f"host{rank}",
        pid=1000 + rank,
        incarnation=uuid.uuid4().hex,
        signature=M.signature(),
        manifest_entries=len(M),
        init_method="tcp://127.0.0.1:29999" if rank == 0 else "",
        launch=LAUNCH,
        restart_count=restart_count,
    )


class Call:
    """A rank's call into the service, as the servicer makes it: `alive` reads the call's
    state in grpc; `gone` is its done callback, which runs later."""

    def __init__(self, c: Coordinator, m: Member, world: int) -> None:
        self.open = True
        self.wake: list[object] = []
        self.events: list[object] = []
        self.task = asyncio.get_running_loop().create_task(self._run(c, m, world))

    async def _run(self, c: Coordinator, m: Member, world: int) -> None:
        events = c.join(
            JoinIntent("race", 0, m, world),
            alive=lambda: self.open,
            on_gone=self.wake.append,
        )
        async for event in events:
            self.events.append(event)
            if isinstance(event, UploadAsk):
                c.upload(event.ref, M, event.key)

    def cancelled_in_grpc(self) -> None:
        """The client cancelled; grpc knows, the done callback has not run yet."""
        self.open = False

    @property
    def verdict(self) -> Verdict | None:
        return next((e for e in self.events if isinstance(e, Verdict)), None)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0.01)


@pytest.mark.timeout(30)
def test_a_call_that_ended_is_not_counted_when_the_cohort_completes() -> None:
    """Rank 3's call is cancelled; before its done callback runs, the last rank joins and
    its restart arrives. The cohort forms with the restart, not the dead call, and the
    restart is not told ALREADY_EXISTS."""

    async def scenario() -> tuple[list[Call], Call, Call]:
        c = Coordinator()
        others = [Call(c, member(r), 4) for r in (0, 1)]
        dying = Call(c, member(3), 4)
        await settle()
        dying.cancelled_in_grpc()
        others.append(Call(c, member(2), 4))  # completes the cohort: 4/4 joined
        await settle()
        assert all(o.verdict is None for o in others), "formed with a call that had ended"
        restart = Call(c, member(3), 4)
        await settle()
        for call in [*others, restart]:
            await asyncio.wait_for(call.task, 5)
        dying.task.cancel()
        c.close()
        return others, dying, restart

    others, dying, restart = asyncio.run(scenario())
    verdicts = [o.verdict for o in [*others, restart]]
    assert all(v is not None and v.outcome is Outcome.FORMED for v in verdicts)
    assert len({v.cohort_id for v in verdicts if v is not None}) == 1
    assert dying.verdict is None


@pytest.mark.timeout(30)
def test_a_restart_takes_the_rank_of_a_call_that_ended_before_its_done_callback_ran() -> None:
    async def scenario() -> tuple[Call, Call]:
        c = Coordinator()
        dying = Call(c, member(1), 2)
        await settle()
        dying.cancelled_in_grpc()
        restart = Call(c, member(1), 2)  # would be ALREADY_EXISTS, then retried
        await settle()
        assert not restart.task.done(), restart.task
        last = Call(c, member(0), 2)
        await asyncio.wait_for(restart.task, 5)
        await asyncio.wait_for(last.task, 5)
        dying.task.cancel()
        c.close()
        return restart, last

    restart, last = asyncio.run(scenario())
    assert restart.verdict is not None and last.verdict is not None
    assert restart.verdict.outcome is Outcome.FORMED
    assert restart.verdict.cohort_id == last.verdict.cohort_id


@pytest.mark.timeout(30)
def test_a_live_predecessor_still_holds_its_rank() -> None:
    """The guard is the call's state, not the new join: while the predecessor's call is
    open, a second process claiming its rank is refused (two processes, one RANK)."""

    async def scenario() -> None:
        c = Coordinator()
        first = Call(c, member(1), 2)
        await settle()
        with pytest.raises(AlreadyHeld):
            async for _ in c.join(JoinIntent("race", 0, member(1), 2)):
                pass
        first.task.cancel()
        c.close()

    asyncio.run(scenario())


def _formed_then_restarted(restart_count: int) -> tuple[list[pb.Verdict | None], object]:
    """Ranks 0-2 wait; rank 3's first process completes the cohort and dies at once; its
    new incarnation (same launch, `restart_count`) joins straight after."""
    c = InProcessCoordinator(join_deadline=30.0, progress_interval=0.2)
    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            reqs = [join_request("again", r, 4, M, launch=LAUNCH) for r in range(3)]
            waiting = [pool.submit(run_rank, c.addr, q, M, 30) for q in reqs]
            give_up = time.monotonic() + 20
            while not _held(c, 3):
                assert time.monotonic() < give_up, "ranks 0-2 never joined"
                time.sleep(0.02)
            first = run_rank(c.addr, join_request("again", 3, 4, M, launch=LAUNCH), M, 30)
            assert first.verdict is not None, first.error  # it completed the cohort
            again = join_request("again", 3, 4, M, launch=LAUNCH, restart_count=restart_count)
            restart = run_rank(c.addr, again, M, timeout=3)
            verdicts = [w.result(timeout=30).verdict for w in waiting]
    finally:
        c.stop()
    return [*verdicts, first.verdict, restart.verdict], restart


def _held(c: InProcessCoordinator, joined: int) -> bool:
    def look() -> bool:
        cohort = c.running.coordinator.find("again")
        return cohort is not None and len(cohort.state.members) == joined

    return bool(c.call(look))


@pytest.mark.timeout(60)
def test_a_restart_that_loses_the_race_with_the_decision_gets_the_rounds_verdict() -> None:
    verdicts, _ = _formed_then_restarted(restart_count=0)
    assert all(v is not None and v.outcome == pb.Verdict.OUTCOME_FORMED for v in verdicts)
    assert len({v.cohort_id for v in verdicts if v is not None}) == 1, "one cohort for all"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_torchrun_restart_after_the_decision_opens_a_new_round() -> None:
    """torchrun restarts every worker with a higher restart count: those join a new round
    together, and a restart of the next generation must not be handed the old verdict."""
    verdicts, restart = _formed_then_restarted(restart_count=1)
    assert verdicts[-1] is None
    error = restart.error  # type: ignore[attr-defined]
    assert error is not None and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    progress = restart.progress  # type: ignore[attr-defined]
    assert progress and progress[0].round == 2, "waits in a new round"


def test_a_successor_rejoining_after_its_round_was_forgotten_joins_the_open_round() -> None:
    """A successor's incarnation is remembered with its round; once that round is forgotten
    (ROUNDS_KEPT newer rounds), its re-join is a join like any other, not a lookup of a
    round that is gone."""
    from cohortgate.coordinator.decision.admit import ROUNDS_KEPT
    from cohortgate.coordinator.service.cohorts import Cohorts

    now = [0.0]
    store = Cohorts(lambda: now[0])

    def form(m: Member) -> None:
        result = store.join(JoinIntent("forgot", 0, m, 1))
        result.cohort.state.manifests[m.signature] = M
        decide_in(store, result.cohort, now[0])
        assert result.cohort.verdict is not None and result.cohort.verdict.outcome.value == "formed"

    form(member(0))
    successor = member(0)
    assert store.join(JoinIntent("forgot", 0, successor, 1)).successor
    for generation in range(1, ROUNDS_KEPT + 1):
        now[0] += 60.0
        form(member(0, restart_count=generation))
    again = store.join(JoinIntent("forgot", 0, successor, 1))
    assert not again.replayed and again.cohort.round == ROUNDS_KEPT + 2


def test_a_rank_started_without_torchrun_restarted_alone_gets_its_rounds_verdict() -> None:
    """No launch (no torchrun): a new process of the same rank on the same host, within the
    successor window, takes its predecessor's place in the decided round; one on another
    host does not."""
    from cohortgate.coordinator.service.cohorts import Cohorts

    store = Cohorts(lambda: 0.0)
    old = member(0)
    old.launch = ""
    result = store.join(JoinIntent("lone", 0, old, 1))
    result.cohort.state.manifests[old.signature] = M
    decide_in(store, result.cohort, 0.0)
    assert result.cohort.verdict is not None
    elsewhere = member(0)
    elsewhere.launch, elsewhere.host = "", "another-host"
    assert not store.join(JoinIntent("lone", 0, elsewhere, 1)).replayed
    store = Cohorts(lambda: 0.0)
    result = store.join(JoinIntent("lone", 0, old, 1))
    result.cohort.state.manifests[old.signature] = M
    decide_in(store, result.cohort, 0.0)
    new = member(0)
    new.launch = ""
    again = store.join(JoinIntent("lone", 0, new, 1))
    assert again.replayed and again.successor and again.cohort is result.cohort


def test_a_torchrun_worker_restarted_with_its_node_joins_the_next_round() -> None:
    """torchrun restarts a healthy node's workers, without raising their restart count,
    when another node re-rendezvouses after a crash: same launch, same count, same model,
    seconds after the decision. They are no successors: the job's next round is theirs."""
    from cohortgate.coordinator.service.cohorts import Cohorts

    store = Cohorts(lambda: 0.0)
    old = member(0)
    old.elastic = True
    result = store.join(JoinIntent("elastic", 0, old, 1))
    result.cohort.state.manifests[old.signature] = M
    decide_in(store, result.cohort, 0.0)
    assert result.cohort.verdict is not None
    new = member(0)
    new.elastic = True
    again = store.join(JoinIntent("elastic", 0, new, 1))
    assert not again.replayed and again.cohort.round == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("via", ["direct", "relay"])
def test_64_jobs_with_16_ranks_restarted_alone_every_rank_gets_one_verdict(
    via: str, tmp_path: Path
) -> None:
    """Issue 37's shape: 64 jobs of 8 ranks at once, started without torchrun; in 16 of them
    rank 7's first process dies right after its first event and a new one joins 50 ms
    later. Every rank of every job gets its verdict (the new rank 7 hung until its deadline
    in 16 of 16 jobs before). bench/stress_restart.py loops it under load."""
    c = InProcessCoordinator(join_deadline=60.0)
    try:
        with contextlib.ExitStack() as stack:
            relay = ""
            if via == "relay":
                relay, _ = stack.enter_context(
                    relay_process(c.addr, tmp_path, "--local-ranks", "4")
                )
            load = Load(shape="lone", launch=False, deadline_s=30.0, relay=relay)
            problems = run_async(run_load(c.addr, load, seed=37))
    finally:
        c.stop()
    assert problems == []
