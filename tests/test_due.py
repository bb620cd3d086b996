"""When a watched cohort next needs a look (decision/audit.py and decision/stall.py `due`,
service/sweeper.py): a sweep that looks only at the cohorts whose time came finds exactly
what a sweep of every cohort at every tick finds (any sequence of calls and ticks); the table
of due times; and the timer that wakes at the earliest of them on a real event loop."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from cohortgate.coordinator.decision.audit import CohortAudits, RankAudit
from cohortgate.coordinator.decision.stall import SILENT_S, Beat, CohortProgress, Snapshot
from cohortgate.coordinator.decision.verdict import Level
from cohortgate.coordinator.service.sweeper import Due, Sweeper
from cohortgate.coordinator.service.watched import Watched
from tests.helpers import examples

WORLD = 3
PLACES = (Snapshot("train (t.py:9)", "all_reduce"), Snapshot("load (d.py:3)"))

# One op: time passes (seconds), then a tick (a sweep) or one rank's call.
beats = st.tuples(
    st.integers(0, WORLD - 1),  # rank
    st.integers(0, 3).map(lambda n: n == 0),  # moves to a new step
    st.sampled_from(["", "", "", "", "", "checkpoint"]),  # paused
    st.integers(0, 40).map(lambda n: n == 0),  # done (rarely)
    st.integers(0, len(PLACES)),  # answers a snapshot asked for (the last: does not)
)
ops = st.lists(
    st.tuples(
        st.sampled_from([0.1, 0.5, 1.0, 2.0, 3.5]),
        st.one_of(st.just("tick"), beats),
    ),
    min_size=10,
    max_size=120,
)


def beat(rank: int, step: int, **kw: object) -> Beat:
    return Beat("c", "j", 1, rank, WORLD, f"h{rank}", f"i{rank}", step, **kw)  # type: ignore[arg-type]


@settings(max_examples=examples(300), deadline=None)
@given(
    ops,
    st.sampled_from([Level.WARN, Level.STRICT]),
    st.sampled_from([2.0, 4.0, None]),
)
@example(  # a rank stops answering at exactly SILENT_S after its beat, not a moment later
    [
        *[(0.4, (0, True, "", False, 0)), (2.1, (0, False, "", False, 0)), (2.0, "tick")],
        *[(2.0, "tick"), (2.0, "tick"), (0.1, "tick")],
    ],
    Level.WARN,
    2.0,
)
@example(  # a pause ends at 29.4 + 3.0, which a float subtraction reads as a moment past it
    [
        *[(0.1, "tick")] * 3,
        *[(0.5, "tick")] * 8,
        *[(3.5, "tick")] * 5,
        *[(3.5, (1, True, "", False, 0)), (0.1, "tick"), (0.5, "tick")],
        *[(3.5, (1, False, "checkpoint", False, 0)), (1.0, "tick"), (2.0, "tick")],
    ],
    Level.WARN,
    2.0,
)
def test_a_stall_sweep_of_only_the_cohorts_due_finds_what_a_sweep_of_all_finds(
    steps: list[tuple[float, object]], level: Level, after: float | None
) -> None:
    every, due_only = (
        CohortProgress("c", "j", WORLD, level, after, pause_limit_s=3.0) for _ in range(2)
    )
    t, at, step = 0.0, None, [0] * WORLD
    for dt, op in steps:
        t += dt
        if op == "tick":
            every.sweep(t)
            if at is not None and at <= t:
                due_only.sweep(t)
        else:
            assert isinstance(op, tuple)
            rank, moves, paused, done, answers = op
            step[rank] += moves
            wanted = every.answer().snapshot_wanted
            snap = PLACES[answers] if wanted and answers < len(PLACES) else None
            b = beat(rank, step[rank], paused=paused, done=done, stall_id=wanted, snapshot=snap)
            every.beat(b, t)
            due_only.beat(b, t)
        at = due_only.due(t)
        for c in (every, due_only):
            assert_kept_as_scanned(c, t)
        assert due_only.new == every.new
        assert due_only.answer() == every.answer()
        every.new.clear()
        due_only.new.clear()


def assert_kept_as_scanned(c: CohortProgress, now: float) -> None:
    """What `beat` keeps so that `due` is O(1) on every beat call (the ranks done, the latest
    pause, the asked ranks that have not answered in the order they go silent) is what a pass
    over every rank finds."""
    ranks = c.ranks.values()
    assert c.done_ranks == sum(r.done for r in ranks)
    limit = c.pause_limit_s
    assert c.paused(now) == any(r.paused and now - r.paused_since <= limit for r in ranks)
    pauses = [r.paused_since for r in ranks if r.paused]
    assert c._latest_pause() == (max(pauses) if pauses else None)
    stall = c.stall
    if stall is not None and not stall.told:
        waiting = [
            r.seen_at
            for k, r in c.ranks.items()
            if now - r.seen_at < SILENT_S and k not in stall.snapshots
        ]
        assert stall.next_silent(now) == (min(waiting) if waiting else None)


def digest(step: int, odd: bool) -> bytes:
    return hashlib.sha256(f"{step}{odd}".encode()).digest()


audits = st.tuples(
    st.integers(0, WORLD - 1),  # rank
    st.integers(0, 6),  # step
    st.integers(0, 5).map(lambda n: n == 0),  # its digest differs
    st.booleans(),  # sends the per-tensor digests asked of it
)


@settings(max_examples=examples(300), deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([0.1, 1.0, 4.0, 11.0]), st.one_of(st.just("tick"), audits)),
        max_size=80,
    ),
    st.sampled_from([Level.WARN, Level.STRICT]),
)
def test_an_audit_sweep_of_only_the_cohorts_due_finds_what_a_sweep_of_all_finds(
    steps: list[tuple[float, object]], level: Level
) -> None:
    bound = 5.0
    every, due_only = (CohortAudits("c", "j", WORLD, level) for _ in range(2))
    t, at = 0.0, None
    for dt, op in steps:
        t += dt
        if op == "tick":
            every.sweep(t, bound)
            if at is not None and at <= t:
                due_only.sweep(t, bound)
        else:
            assert isinstance(op, tuple)
            rank, step, odd, answers = op
            asked = dict(every.answer().tensors_for)
            sent = asked.get(rank) if answers else None
            for c in (every, due_only):
                c.add(RankAudit("c", "j", 1, rank, WORLD, "h", "i", step, digest(step, odd)), t)
                if sent is not None:
                    names = (("w", digest(sent, odd)),)
                    c.add(RankAudit("c", "j", 1, rank, WORLD, "h", "i", sent, b"", "", names), t)
        at = due_only.due(bound)
        assert due_only.new == every.new
        assert due_only.answer() == every.answer()
        every.new.clear()
        due_only.new.clear()


def test_the_table_hands_out_each_key_once_when_due_earliest_first() -> None:
    due = Due()
    due.set("b", 5.0)
    due.set("a", 3.0)
    due.set("c", 9.0)
    due.set("b", 2.0)  # moved sooner: its old time is dropped
    due.set("c", None)  # nothing due any more
    assert due.next_at() == 2.0
    assert due.pop(4.0) == ["b", "a"]
    assert due.pop(100.0) == []
    assert len(due) == 0 and due.next_at() is None


def test_keys_moved_again_and_again_keep_the_table_small() -> None:
    due = Due()
    for i in range(10_000):
        due.set(f"k{i % 10}", float(i))
    assert len(due) == 10
    assert len(due._heap) <= 2 * 10 + 64 + 1
    assert due.pop(9_995.0) == [f"k{i}" for i in range(6)]  # each at its last time only


def test_the_timer_wakes_at_the_earliest_due_time_not_at_its_tick() -> None:
    """A key due 50 ms from now is swept then, though the tick is a minute; a call that
    brings a key forward brings the timer forward."""

    async def main() -> list[str]:
        due, swept, woke = Due(), [], asyncio.Event()

        def sweep() -> None:
            swept.extend(due.pop(time.monotonic()))
            if swept:
                woke.set()

        sweeper = Sweeper("test", 60.0, sweep, lambda: True, due, time.monotonic)
        due.set("far", time.monotonic() + 3600)
        sweeper.start()  # the timer set a minute out
        due.set("soon", time.monotonic() + 0.05)
        sweeper.start()  # brought forward
        try:
            await asyncio.wait_for(woke.wait(), 20)
        finally:
            sweeper.close()
        return swept

    assert asyncio.run(main()) == ["soon"]


def test_a_cohort_forgotten_is_due_no_more() -> None:
    @dataclass
    class Seen:
        last_seen: float

    watched = Watched[Seen](
        limit=2, room_idle_s=5.0, formed=None, noun="mark", participle="watched", sized=print
    )
    for key, seen in (("old", 0.0), ("new", 9.0)):
        watched.take(key, "j", 1, seen, lambda hosts, at=seen: Seen(at))  # type: ignore[misc]
        watched.due.set(key, 20.0)
    watched.take("third", "j", 1, 10.0, lambda hosts: Seen(10.0))  # room made: "old" goes
    assert sorted(watched.cohorts) == ["new", "third"]
    looked: list[float] = []

    def look(c: Seen) -> None:
        looked.append(c.last_seen)

    watched.look_due(20.0, look)
    assert looked == [9.0] and len(watched.due) == 0
