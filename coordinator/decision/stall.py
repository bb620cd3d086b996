"""Stalls while they happen: a formed cohort whose ranks mark steps (`cohort.step(n)`,
`cohort.audit(model, n)`) is *stalled* when no rank has reached a new step for the stall
bound, and the job has neither finished nor gone. Then every rank is asked for a snapshot
(its main thread's innermost frames, answered from the agent's background thread, which runs
while the main thread waits in a collective); after SNAPSHOT_WAIT_S, or once every rank has
answered, the ranks are grouped by where they are, the smallest group first (the odd one out
is the likely cause), and the ranks that did not answer are named with their hosts. The stall
is told once per change, and closed with its duration when a rank moves again.

Pure: no clock but the one passed in, no I/O. `service/stalls.py` drives it.
"""

from __future__ import annotations

import heapq
import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from cohortgate.coordinator.decision.stall_report import SNAPSHOT_WAIT_S, stall_words
from cohortgate.coordinator.decision.verdict import Level

# `auto` stall bound: this many times the cohort's median step time, and at least MIN_AUTO_S.
AUTO_STEPS = 20
MIN_AUTO_S = 60.0
# A rank that sent nothing (not even an unchanged step) for this long is not answering: a
# SIGSTOPped or dead process, a lost host. Agents beat every BEAT_S (agent/audit.py).
SILENT_S = 6.0
# Step intervals kept per cohort for the median.
INTERVALS = 64
# Stragglers: a rank's step time is taken over its last 8 to 16 marks (from an anchor moved
# every STRAGGLER_WINDOW marks: a few numbers a rank, not a list), at least
# STRAGGLER_MIN_STEPS steps, against the median of its cohort's ranks.
STRAGGLER_WINDOW = 8
STRAGGLER_MIN_STEPS = 8
STRAGGLERS_SHOWN = 8
# Frames kept per snapshot (innermost first); the report (decision/stall_report.py) shows
# fewer.
MAX_FRAMES = 32


@dataclass(frozen=True)
class Snapshot:
    """Where one rank's main thread is: its innermost frame of user code (`where`, as
    "function (file:line)"), the library call it is in below that (`call`, "" when the
    innermost frame is user code) and the outermost library frame it went through (`via`,
    "" when the same), and its frames, innermost first ("file:line in function")."""

    where: str
    call: str = ""
    via: str = ""
    frames: tuple[str, ...] = ()

    def text(self) -> str:
        if not self.call:
            return f"in {self.where}"
        fn, _, place = self.where.partition(" (")
        place = place.rstrip(")")
        via = f", via {self.via}" if self.via and self.via != self.call else ""
        return f"in {self.call} ({place}{via})" if place else f"in {self.call} (in {fn}{via})"


@dataclass(frozen=True)
class Beat:
    """One rank's progress: the last step it reached and how long ago (by its own clock:
    no skew between hosts), an on-purpose pause, that it is done, and a snapshot when
    asked (`stall_id`: the stall it answers)."""

    cohort_id: str
    job_id: str
    round: int
    rank: int
    world_size: int
    host: str
    incarnation: str
    step: int
    step_age_s: float = 0.0
    paused: str = ""  # the reason of `with cohort.pause(reason):`, "" when not paused
    paused_s: float = 0.0  # for how long
    done: bool = False  # the rank closed its cohort (its training ended)
    stall_id: int = 0
    snapshot: Snapshot | None = None


@dataclass(frozen=True)
class StallAnswer:
    """What every rank of the cohort hears after its beat."""

    snapshot_wanted: int = 0  # a stall's id: send a snapshot with the next beat
    stall_id: int = 0  # the stall reported (0: none now)
    headline: str = ""
    report: str = ""
    stop: bool = False  # strict: end the job with the report


@dataclass(frozen=True)
class StallEvent:
    """A change to tell: a stall found (with its report), or one that ended."""

    kind: str  # "stalled" | "resumed"
    cohort_id: str
    job_id: str
    step: int
    level: str
    headline: str
    report: str
    at: float
    stalled_s: float = 0.0


@dataclass(slots=True)
class _Rank:
    """What the coordinator holds of one rank: a few numbers (a job of 100k ranks holds
    100k of these)."""

    host: str
    step: int
    reached_at: float  # coordinator time the step was reached
    seen_at: float  # the last beat
    paused: str = ""
    paused_since: float = 0.0
    done: bool = False
    # (older anchor's step, its time, newer anchor's step, its time, marks since the newer)
    window: tuple[int, float, int, float, int] = (-1, 0.0, -1, 0.0, 0)

    def mark(self, step: int, at: float) -> None:
        """A new step reached at `at`: the anchors move every STRAGGLER_WINDOW marks."""
        older_step, older_at, newer_step, newer_at, since = self.window
        if newer_step < 0:
            self.window = (step, at, step, at, 0)
        elif since + 1 >= STRAGGLER_WINDOW:
            self.window = (newer_step, newer_at, step, at, 0)
        else:
            self.window = (older_step, older_at, newer_step, newer_at, since + 1)

    def step_s(self) -> float | None:
        """Seconds per step since the older anchor (None: too few steps yet)."""
        older_step, older_at = self.window[:2]
        if older_step < 0 or self.step - older_step < STRAGGLER_MIN_STEPS:
            return None
        return (self.reached_at - older_at) / (self.step - older_step)


@dataclass(frozen=True)
class Straggler:
    rank: int
    host: str
    step_s: float
    median_s: float

    def text(self) -> str:
        ratio = self.step_s / self.median_s if self.median_s > 0 else float("inf")
        return (
            f"rank {self.rank} on {self.host or '?'}: {self.step_s:.3g} s a step, "
            f"{ratio:.1f}x its cohort's median {self.median_s:.3g} s"
        )


@dataclass
class Stall:
    id: int
    since: float  # the last progress
    asked_at: float
    step: int
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    headline: str = ""
    report: str = ""
    told: bool = False
    # The ranks asked that have not answered, with their last beat, oldest first (the
    # coordinator's clock only moves on, so a beat moves its rank to the end): the front is
    # the next to stop counting as answering. Silent ones are dropped from the front as it
    # is read, and come back at the end if they beat again.
    # (An OrderedDict: a plain dict read from the front after deletions there walks them.)
    waiting: OrderedDict[int, float] = field(default_factory=OrderedDict)

    def next_silent(self, now: float) -> float | None:
        """The last beat of the asked rank that has answered nothing and will stop counting
        as answering first (None: every rank answering has answered). Amortised O(1)."""
        while self.waiting:
            rank = next(iter(self.waiting))
            if now - self.waiting[rank] < SILENT_S:
                return self.waiting[rank]
            del self.waiting[rank]
        return None

    def beat(self, rank: int, now: float) -> None:
        if rank in self.snapshots:
            self.waiting.pop(rank, None)
        else:
            self.waiting[rank] = now
            self.waiting.move_to_end(rank)


def stall_bound(setting: float | None, median_step_s: float | None) -> float | None:
    """The seconds without progress that make a stall: the setting, or (auto, None) AUTO_STEPS
    times the median step time and at least MIN_AUTO_S; None while auto has no step time."""
    if setting is not None:
        return setting
    if median_step_s is None:
        return None
    return max(MIN_AUTO_S, AUTO_STEPS * median_step_s)


class CohortProgress:
    """The steps of one formed cohort's ranks, and its stall if it has one."""

    def __init__(
        self,
        cohort_id: str,
        job_id: str,
        world_size: int,
        level: Level,
        stall_after_s: float | None = None,
        pause_limit_s: float = 1800.0,
        first_stall_id: int = 1,
    ) -> None:
        self.cohort_id, self.job_id, self.world_size = cohort_id, job_id, world_size
        self.level, self.stall_after_s, self.pause_limit_s = level, stall_after_s, pause_limit_s
        self.ranks: dict[int, _Rank] = {}
        self.hosts: dict[int, str] = {}
        self.intervals: deque[float] = deque(maxlen=INTERVALS)
        self.top_step = -1
        self.top_at = 0.0
        self.last_progress = 0.0
        self.last_seen = 0.0
        self.stall: Stall | None = None
        self.stalls = 0  # stalls found so far
        # Stall ids: ranks tell each stall once by its id; a coordinator that takes over a
        # job (a restart, a failover) numbers its stalls past the ones already told.
        self.first_stall_id = first_stall_id
        self.new: list[StallEvent] = []
        # Kept by `beat` so that `due`, asked on every beat call, is O(1) however many ranks:
        # the ranks done, and the paused ranks' start times (a lazy max-heap over them).
        self.done_ranks = 0
        self._pauses: dict[int, float] = {}
        self._pause_heap: list[tuple[float, int]] = []

    # -- beats -----------------------------------------------------------------------------
    def beat(self, b: Beat, now: float) -> None:
        reached = now - max(0.0, b.step_age_s)
        self.last_seen = now
        self.hosts[b.rank] = b.host
        r = self.ranks.get(b.rank)
        if r is None:
            r = self.ranks[b.rank] = _Rank(b.host, b.step, reached, now)
            r.mark(b.step, reached)
            self._progress(reached)
        elif b.step > r.step:
            r.step, r.reached_at = b.step, reached
            r.mark(b.step, reached)
            self._progress(reached)
        self.done_ranks += b.done and not r.done
        r.seen_at, r.host, r.done = now, b.host, r.done or b.done
        if b.paused:
            if not r.paused:
                r.paused_since = now - max(0.0, b.paused_s)
                self._pause(b.rank, r.paused_since)
            r.paused = b.paused
        elif r.paused:
            r.paused = ""
            del self._pauses[b.rank]
            self._progress(now)  # a pause ended: its time is not the job's stall
        if b.step > self.top_step:
            if self.top_step >= 0 and reached > self.top_at:
                self.intervals.append((reached - self.top_at) / (b.step - self.top_step))
            self.top_step, self.top_at = b.step, reached
        stall = self.stall
        if stall is not None:
            if b.snapshot is not None and b.stall_id == stall.id:
                stall.snapshots[b.rank] = b.snapshot
            stall.beat(b.rank, now)

    def _pause(self, rank: int, since: float) -> None:
        self._pauses[rank] = since
        heapq.heappush(self._pause_heap, (-since, rank))
        if len(self._pause_heap) > 2 * len(self._pauses) + 64:  # ended pauses piled up
            self._pause_heap = [(-t, k) for k, t in self._pauses.items()]
            heapq.heapify(self._pause_heap)

    def _latest_pause(self) -> float | None:
        """When the latest pause of the ranks paused now began (None: none is)."""
        heap = self._pause_heap
        while heap and self._pauses.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)  # a pause that ended (or began again since)
        return -heap[0][0] if heap else None

    def _progress(self, at: float) -> None:
        self.last_progress = max(self.last_progress, at)
        stall = self.stall
        if stall is not None and self.last_progress > stall.since:
            self.stall = None
            if stall.told:
                stalled_s = at - stall.since
                self.new.append(
                    StallEvent(
                        "resumed",
                        self.cohort_id,
                        self.job_id,
                        stall.step,
                        str(self.level),
                        f"moved again after {stalled_s:.0f} s stalled at step {stall.step}",
                        "",
                        at,
                        stalled_s,
                    )
                )

    def median_step_s(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None

    def stragglers(self, ratio: float) -> list[Straggler]:
        """Ranks whose steps take `ratio` times their cohort's median or longer (over their
        last 8 to 16 marks), slowest first; none while fewer than 3 ranks have a step time, or when
        `ratio` is 0 (off)."""
        timed = {k: t for k, r in self.ranks.items() if (t := r.step_s()) is not None}
        if ratio <= 0 or len(timed) < 3:
            return []
        median = statistics.median(timed.values())
        slow = [
            Straggler(k, self.ranks[k].host, t, median)
            for k, t in timed.items()
            if t > ratio * median and t > 0
        ]
        return sorted(slow, key=lambda s: (-s.step_s, s.rank))

    def bound(self) -> float | None:
        return stall_bound(self.stall_after_s, self.median_step_s())

    # -- the sweep -------------------------------------------------------------------------
    def paused(self, now: float) -> bool:
        """Some rank is in an on-purpose pause, within the operator's bound."""
        latest = self._latest_pause()
        return latest is not None and now - latest <= self.pause_limit_s

    def sweep(self, now: float) -> None:
        """Find a stall, or finish one whose snapshots are in."""
        if self.level is Level.OFF or not self.ranks:
            return
        stall = self.stall
        if stall is None:
            bound = self.bound()
            if (
                bound is None
                or now - self.last_progress < bound
                # Ranks that still beat, past the bound, and show no new step: a stall. Marks
                # that stopped coming with the steps (a cut link, a job that ended or was
                # killed) say nothing about the job: unheard is not stalled. No rank answering:
                # none beat SILENT_S before now (the last beat is the latest of any rank's).
                or self.last_seen < self.last_progress + bound
                or now - self.last_seen >= SILENT_S
                or self.paused(now)
                or self.done_ranks
            ):
                return
            by_beat = sorted(self.ranks.items(), key=lambda kv: kv[1].seen_at)
            self.stall = Stall(
                self.first_stall_id + self.stalls,
                self.last_progress,
                now,
                self.top_step,
                waiting=OrderedDict((k, r.seen_at) for k, r in by_beat),
            )
            self.stalls += 1
            return
        if stall.told:
            return
        waited = now - stall.asked_at >= SNAPSHOT_WAIT_S
        if not waited and stall.next_silent(now) is not None:
            return  # ranks answering have not answered yet
        if not stall.snapshots:
            # Asked, and nobody answered: the link went with the question. Not a report of
            # where anyone is; asked again once ranks beat again without progress.
            self.stall = None
            return
        stall.headline, stall.report = stall_words(self, stall, now)
        stall.told = True
        self.new.append(
            StallEvent(
                "stalled",
                self.cohort_id,
                self.job_id,
                stall.step,
                str(self.level),
                stall.headline,
                stall.report,
                now,
                now - stall.since,
            )
        )

    def due(self, now: float) -> float | None:
        """When a sweep could next change something if no rank beats before (None: only a
        beat can; every beat asks again). Never later than the sweep that would act. Asked on
        every beat call: O(1) (amortised) however many ranks the cohort has."""
        if self.level is Level.OFF or not self.ranks:
            return None
        stall = self.stall
        if stall is None:
            # A stall needs a beat past the bound and a rank answering (none SILENT_S after
            # the last beat, the latest of any rank's).
            bound = self.bound()
            if (
                bound is None
                or self.last_seen < self.last_progress + bound
                or now - self.last_seen >= SILENT_S
                or self.done_ranks
            ):
                return None
            latest = self._latest_pause()
            # exactly at its end, never after (float rounding could make that a moment late)
            return latest + self.pause_limit_s if self.paused(now) and latest is not None else now
        if stall.told:
            return None  # until a rank moves (a beat)
        silent_next = stall.next_silent(now)  # the moment it stops counting as answering
        if silent_next is None:
            return now
        return min(stall.asked_at + SNAPSHOT_WAIT_S, silent_next + SILENT_S)

    def answer(self) -> StallAnswer:
        stall = self.stall
        if stall is None or self.level is Level.OFF:
            return StallAnswer()
        if not stall.told:
            return StallAnswer(snapshot_wanted=stall.id)
        return StallAnswer(
            stall_id=stall.id,
            headline=stall.headline,
            report=stall.report,
            stop=self.level is Level.STRICT,
        )
