"""Stalls while they happen (decision/stall.py, agent/stack.py): when a formed cohort counts
as stalled, what its ranks are asked, the report that groups them (the odd one out first),
and where a snapshot says a thread is. Pure: a clock passed in, real frames."""

from __future__ import annotations

import sys
import threading

import pytest

from cohortgate.agent import stack
from cohortgate.coordinator.decision.stall import (
    MIN_AUTO_S,
    SILENT_S,
    Beat,
    CohortProgress,
    Snapshot,
    StallAnswer,
    stall_bound,
)
from cohortgate.coordinator.decision.stall_report import SNAPSHOT_WAIT_S
from cohortgate.coordinator.decision.verdict import Level
from cohortgate.coordinator.edge.config import parse_stall_after

JOB = "hung"
COHORT = f"{JOB}/1/abcd"
WAITING = Snapshot("train (train.py:88)", "all_reduce", "", ("c10d.py:2 in all_reduce",))
STUCK = Snapshot("wait_for_batch (data.py:31)", "", "", ("data.py:31 in wait_for_batch",))


def beat(rank: int, step: int, **kw: object) -> Beat:
    fields: dict[str, object] = {"host": f"node-{rank // 8}", "incarnation": f"i{rank}"}
    fields.update(kw)
    return Beat(COHORT, JOB, 1, rank, fields.pop("world", 4), step=step, **fields)  # type: ignore[arg-type]


def progress(
    level: Level = Level.WARN, after: float | None = 10.0, world: int = 4
) -> CohortProgress:
    return CohortProgress(COHORT, JOB, world, level, after, pause_limit_s=100.0)


def run_steps(c: CohortProgress, steps: int, dt: float, t0: float = 0.0, ranks: int = 4) -> float:
    """Every rank reaches steps 0..steps-1, dt apart; the time of the last."""
    t = t0
    for s in range(steps):
        t = t0 + s * dt
        for r in range(ranks):
            c.beat(beat(r, s, world=ranks), t)
    return t


def keep_beating(c: CohortProgress, at: float, silent: tuple[int, ...] = ()) -> None:
    """Every rank but `silent` beats at `at`, its step unchanged (waiting somewhere)."""
    for rank, r in c.ranks.items():
        if rank not in silent:
            c.beat(beat(rank, r.step, world=c.world_size), at)


def stall_of(
    c: CohortProgress, at: float, snapshots: dict[int, Snapshot], silent: tuple[int, ...] = ()
) -> tuple[str, str]:
    """The ranks beat, unchanged, at `at`; sweep at `at` (the stall is found, snapshots
    asked), answer with `snapshots` (each rank's beat carries its own), sweep again: the
    headline and report told."""
    keep_beating(c, at, silent)
    c.sweep(at)
    wanted = c.answer().snapshot_wanted
    assert wanted, "no stall found"
    for rank in range(c.world_size):
        if rank in snapshots:
            c.beat(
                beat(
                    rank,
                    c.ranks[rank].step,
                    stall_id=wanted,
                    snapshot=snapshots[rank],
                    world=c.world_size,
                ),
                at + 1,
            )
    c.sweep(at + 1 if len(snapshots) == c.world_size else at + 1 + SNAPSHOT_WAIT_S)
    (event,) = [e for e in c.new if e.kind == "stalled"]
    return event.headline, event.report


def test_no_stall_while_some_rank_reaches_new_steps_within_the_bound() -> None:
    c = progress()
    t = run_steps(c, 50, 0.2)
    for r in range(4):
        c.beat(beat(r, 49), t + 9.0)  # beats, the step unchanged
    c.sweep(t + 9.9)
    assert c.answer() == StallAnswer() and not c.new


def test_a_stall_asks_every_rank_for_a_snapshot_then_reports_the_odd_one_first() -> None:
    c = progress()
    t = run_steps(c, 6, 0.2)
    for r in (0, 1, 3):
        c.beat(beat(r, 5), t + 5)  # still beating: waiting in a collective
    c.beat(beat(2, 5), t + 5)
    headline, report = stall_of(c, t + 10.5, {0: WAITING, 1: WAITING, 2: STUCK, 3: WAITING})
    assert headline == (
        "stalled at step 5 for 12 s: rank 2 on node-0 in wait_for_batch (data.py:31); "
        "ranks 0-1,3 on node-0 in all_reduce (train.py:88)"
    )
    assert report.splitlines()[0] == (
        f"job '{JOB}' (cohort {COHORT}): no rank reached a new step for 12 s (stall bound 10 s)"
    )
    assert (
        "rank 2 on node-0 in wait_for_batch (data.py:31):\n    data.py:31 in wait_for_batch"
        in report
    )
    assert "last steps: ranks 0-3 at step 5 (12 s ago)" in report
    answer = c.answer()
    assert (answer.stall_id, answer.headline, answer.stop) == (1, headline, False)


def test_strict_tells_every_rank_to_stop_and_off_asks_nothing() -> None:
    strict = progress(Level.STRICT)
    t = run_steps(strict, 3, 1.0)
    stall_of(strict, t + 11, dict.fromkeys(range(4), WAITING))
    assert strict.answer().stop
    off = progress(Level.OFF)
    t = run_steps(off, 3, 1.0)
    off.sweep(t + 100)
    assert off.answer() == StallAnswer() and not off.new


def test_a_rank_that_does_not_answer_is_named_with_its_host() -> None:
    c = progress(world=16)
    t = run_steps(c, 3, 1.0, ranks=16)  # then rank 12 goes silent
    snaps = {r: WAITING for r in range(16) if r not in (7, 12)} | {7: STUCK}
    headline, report = stall_of(c, t + 10.5, snaps, silent=(12,))
    assert headline.endswith(
        "rank 7 on node-0 in wait_for_batch (data.py:31); "
        "ranks 0-6,8-11,13-15 in all_reduce (train.py:88); no answer from rank 12 on node-1"
    ), headline
    assert "no answer from rank 12 on node-1 within 5 s" in report


def test_the_report_waits_for_every_answering_rank_but_not_past_the_snapshot_wait() -> None:
    c = progress()
    t = run_steps(c, 3, 1.0)
    keep_beating(c, t + 10)
    c.sweep(t + 10.5)
    wanted = c.answer().snapshot_wanted
    c.beat(beat(0, 2, stall_id=wanted, snapshot=WAITING), t + 11)
    c.sweep(t + 11)  # ranks 1-3 beat lately (before the stall) and may still answer
    assert not c.new and c.answer().snapshot_wanted == wanted
    c.sweep(t + 10.5 + SNAPSHOT_WAIT_S)
    (event,) = c.new
    assert "no answer from ranks 1-3" in event.headline


def test_a_snapshot_of_another_stall_is_not_taken() -> None:
    c = progress()
    t = run_steps(c, 3, 1.0)
    keep_beating(c, t + 10)
    c.sweep(t + 10.5)
    wanted = c.answer().snapshot_wanted
    c.beat(beat(0, 2, stall_id=wanted + 1, snapshot=STUCK), t + 11)
    assert c.stall is not None and c.stall.snapshots == {}


def test_a_step_after_the_stall_closes_it_with_its_duration() -> None:
    c = progress()
    t = run_steps(c, 3, 1.0)
    stall_of(c, t + 11, dict.fromkeys(range(4), WAITING))
    c.new.clear()
    c.beat(beat(1, 3), t + 40)
    (event,) = c.new
    assert (event.kind, event.step) == ("resumed", 2)
    assert event.headline == "moved again after 40 s stalled at step 2"
    assert c.answer() == StallAnswer()


def test_a_stall_that_was_never_reported_ends_silently() -> None:
    c = progress()
    t = run_steps(c, 3, 1.0)
    keep_beating(c, t + 10)
    c.sweep(t + 10.5)  # found, snapshots asked
    c.beat(beat(0, 3), t + 11)
    assert c.stall is None and not c.new


@pytest.mark.parametrize(
    ("steps_s", "bound"), [(0.2, MIN_AUTO_S), (1.0, MIN_AUTO_S), (30.0, 600.0)]
)
def test_auto_is_twenty_median_steps_and_at_least_a_minute(steps_s: float, bound: float) -> None:
    c = progress(after=None)
    assert c.bound() is None  # no step time yet: nothing is called a stall
    t = run_steps(c, 10, steps_s)
    assert c.bound() == pytest.approx(bound)
    keep_beating(c, t + bound - 1)
    c.sweep(t + bound - 0.5)
    assert not c.answer().snapshot_wanted
    keep_beating(c, t + bound + 0.2)
    c.sweep(t + bound + 0.5)
    assert c.answer().snapshot_wanted


def test_stall_bound_by_setting_or_auto() -> None:
    assert stall_bound(5.0, None) == 5.0
    assert stall_bound(None, None) is None
    assert stall_bound(None, 10.0) == 200.0


def test_a_pause_on_purpose_is_skipped_up_to_the_limit() -> None:
    c = progress()
    t = run_steps(c, 3, 1.0)
    c.beat(beat(0, 2, paused="checkpoint", paused_s=0.0), t + 1)
    keep_beating(c, t + 49)
    c.sweep(t + 50)
    assert not c.answer().snapshot_wanted  # paused (the limit is 100 s)
    keep_beating(c, t + 101)
    c.sweep(t + 102)  # past the limit: a pause that long is a stall too
    assert c.answer().snapshot_wanted


def test_the_end_of_a_pause_restarts_the_clock() -> None:
    c = progress()
    t = run_steps(c, 3, 1.0)
    c.beat(beat(0, 2, paused="checkpoint"), t + 1)
    c.beat(beat(0, 2), t + 30)  # the pause ended; no step since
    keep_beating(c, t + 38)
    c.sweep(t + 39)
    assert not c.answer().snapshot_wanted
    keep_beating(c, t + 40.2)
    c.sweep(t + 40.5)
    assert c.answer().snapshot_wanted


def test_a_job_that_finished_or_went_silent_is_not_stalled() -> None:
    done = progress()
    t = run_steps(done, 3, 1.0)
    done.beat(beat(0, 2, done=True), t)
    done.sweep(t + 100)
    assert not done.answer().snapshot_wanted
    gone = progress()
    t = run_steps(gone, 3, 1.0)
    gone.sweep(t + SILENT_S + 11)  # no rank beat since: the job ended or was killed
    assert not gone.answer().snapshot_wanted


def test_the_age_a_rank_reports_dates_its_step() -> None:
    c = progress()
    c.beat(beat(0, 7, step_age_s=4.0), 100.0)
    assert c.last_progress == 96.0
    c.beat(beat(0, 7, step_age_s=0.0), 101.0)  # the same step: no progress
    assert c.last_progress == 96.0


def test_many_places_are_counted_in_the_headline_and_scattered_ranks_capped() -> None:
    c = progress(world=64)
    t = run_steps(c, 2, 1.0, ranks=64)
    snaps = {r: Snapshot(f"f{r % 6} (x.py:{r % 6})") for r in range(64)}
    headline, _ = stall_of(c, t + 11, snaps)
    assert headline.count(" in f") == 4 and headline.endswith("; 2 more places")


def test_a_rank_persistently_slower_than_its_cohorts_median_is_a_straggler() -> None:
    c = progress(world=4)
    for second in range(20):  # ranks 0-2 mark 5 steps a second, rank 3 two
        for r in range(3):
            c.beat(beat(r, 5 * second), float(second))
        c.beat(beat(3, 2 * second, host="node-9"), float(second))
    (slow,) = c.stragglers(1.5)
    assert slow.text() == "rank 3 on node-9: 0.5 s a step, 2.5x its cohort's median 0.2 s"
    assert c.stragglers(3.0) == [] and c.stragglers(0) == []  # a higher bar, or off
    few = progress(world=2)
    for second in range(20):
        few.beat(beat(0, 5 * second, world=2), float(second))
        few.beat(beat(1, second, world=2), float(second))
    assert few.stragglers(1.5) == []  # two ranks: no median to stand out from


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("auto", (None, ())),
        ("30", (30.0, ())),
        ("30,big:auto,small:5", (30.0, (("big", None), ("small", 5.0)))),
        ("a:b:7", (None, (("a:b", 7.0),))),
    ],
)
def test_stall_after_parses(text: str, parsed: object) -> None:
    assert parse_stall_after(text) == parsed


@pytest.mark.parametrize("text", ["0", "-3", "soon", "job:", "nan", "inf"])
def test_stall_after_refuses_what_is_not_seconds(text: str) -> None:
    with pytest.raises(ValueError, match="want SECONDS"):
        parse_stall_after(text)


# -- snapshots (agent/stack.py) --------------------------------------------------------------
LIB = "/usr/lib/python3/site-packages/"


def test_a_thread_in_user_code_is_where_it_is() -> None:
    def wait_for_batch(ready: threading.Event, go: threading.Event) -> None:
        ready.set()
        go.wait(10)

    ready, go = threading.Event(), threading.Event()
    t = threading.Thread(target=wait_for_batch, args=(ready, go))
    t.start()
    try:
        ready.wait(5)
        frame = sys._current_frames()[t.ident or 0]
        w = stack.where(frame)
    finally:
        go.set()
        t.join()
    # threading's wait() is the standard library's: the innermost user frame is ours
    assert w.where.startswith("test_a_thread_in_user_code_is_where_it_is.<locals>.wait_for_batch (")
    assert (w.call, w.via) == ("Condition.wait", "Event.wait")
    assert w.frames[0].endswith("in Condition.wait")


def test_library_frames_name_the_public_call_and_the_way_in() -> None:
    code = compile(
        "def _engine(): return where(sys._getframe(), libraries=LIBS)\n"
        "def backward(): return _engine()\n"
        "class Tensor:\n    def backward(self): return backward()\n"
        "def _call_impl(): return Tensor().backward()\n",
        LIB + "torch/fake.py",
        "exec",
    )
    lib: dict[str, object] = {"sys": sys, "where": stack.where, "LIBS": (LIB,)}
    exec(code, lib)
    user = compile("def train(f): return f()\n", "/home/me/train.py", "exec")
    mine: dict[str, object] = {}
    exec(user, mine)
    w = mine["train"](lib["_call_impl"])  # type: ignore[operator]
    assert (w.call, w.via) == ("backward", "Tensor.backward")  # not _engine, nor the wrapper
    assert w.where == "train (/home/me/train.py:1)"
    assert w.frames[:2] == ("torch/fake.py:1 in _engine", "torch/fake.py:2 in backward")
    assert Snapshot(w.where, w.call, w.via).text() == (
        "in backward (/home/me/train.py:1, via Tensor.backward)"
    )


def test_a_stack_of_library_frames_only_names_its_innermost() -> None:
    code = compile(
        "def run(): return where(sys._getframe(), libraries=LIBS)\n", LIB + "pkg/loop.py", "exec"
    )
    # every frame a library's (this test's own too, under "/"), on a thread of its own: the
    # main thread of an xdist worker starts in `python -c` code (<string>: the program's)
    lib: dict[str, object] = {"sys": sys, "where": stack.where, "LIBS": (LIB, "/")}
    exec(code, lib)
    got: list[stack.Where] = []
    t = threading.Thread(target=lambda: got.append(lib["run"]()))  # type: ignore[operator]
    t.start()
    t.join()
    (w,) = got
    assert (w.where, w.call, w.via) == ("pkg/loop.py:1 in run", "", "")


def test_torch_is_a_library_and_an_installed_trainer_is_the_programs_code() -> None:
    """A frame in site-packages/torch names the call; one in site-packages/transformers (or a
    team's trainer package) is where the rank is."""
    import sysconfig

    import torch

    libraries = stack._library_dirs()
    site = sysconfig.get_paths()["purelib"]
    assert stack.is_library(torch.__file__, libraries)
    assert stack.is_library(threading.__file__, libraries)  # the standard library
    assert stack.is_library(stack.__file__, libraries)  # cohortgate itself
    assert not stack.is_library(f"{site}/transformers/trainer.py", libraries)
    assert not stack.is_library("/home/me/train.py", libraries)
    assert not stack.is_library("<string>", libraries)  # python -c
    assert stack.is_library("<frozen importlib._bootstrap>", libraries)


def test_the_main_thread_is_read_from_another_thread() -> None:
    got: list[stack.Where] = []
    t = threading.Thread(target=lambda: got.append(stack.main_thread()))
    t.start()
    t.join()
    assert "test_the_main_thread_is_read_from_another_thread" in got[0].where


def test_a_snapshot_is_bounded_however_deep_the_stack() -> None:

    def deep(n: int) -> stack.Where:
        return deep(n - 1) if n else stack.where(sys._getframe())

    w = deep(300)
    assert len(w.frames) == stack.MAX_FRAMES and all(len(f) <= stack.MAX_TEXT for f in w.frames)


def test_stall_ids_start_where_the_coordinator_says() -> None:
    """A coordinator that takes a job over (a restart, a failover) numbers its stalls past
    those the ranks were told: a rank tells each stall id once."""
    c = CohortProgress(COHORT, JOB, 4, Level.WARN, 10.0, first_stall_id=7_000)
    t = run_steps(c, 3, 1.0)
    stall_of(c, t + 11, dict.fromkeys(range(4), WAITING))
    assert c.answer().stall_id == 7_000


def test_marks_that_stop_with_the_steps_are_no_stall() -> None:
    """A link cut (or a job killed) as the steps stop: the last marks came before the bound
    ran out, so nothing says the ranks are alive and not moving. Unheard is not stalled
    (a partition of 8 s under --stall-after 3 was called a stall; under strict)."""
    c = progress(after=3.0)
    t = run_steps(c, 5, 0.2)
    keep_beating(c, t + 2.0)  # then nothing
    c.sweep(t + 3.5)  # the bound ran out; ranks still count as answering (6 s)
    assert c.answer() == StallAnswer() and not c.new
    keep_beating(c, t + 4.0)  # the link is back, the steps are not: a stall
    c.sweep(t + 4.1)
    assert c.answer().snapshot_wanted


def test_a_stall_nobody_answers_is_not_reported() -> None:
    """Asked, and every rank went quiet with the question (the link went): no report of
    where nobody is; the stall is asked again once ranks beat again without progress."""
    c = progress(after=3.0)
    t = run_steps(c, 5, 0.2)
    keep_beating(c, t + 3.2)
    c.sweep(t + 3.5)
    assert c.answer().snapshot_wanted
    c.sweep(t + 3.5 + SNAPSHOT_WAIT_S)
    assert not c.new and c.answer() == StallAnswer()
