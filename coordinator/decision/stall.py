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

import statistics
from collections import deque
from dataclasses import dataclass, field

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.decision.verdict import Level
from cohortgate.coordinator.decision.words import plural

# `auto` stall bound: this many times the cohort's median step time, and at least MIN_AUTO_S.
AUTO_STEPS = 20
MIN_AUTO_S = 60.0
# How long the ranks have to answer a snapshot request before the report goes out without
# the ones that did not.
SNAPSHOT_WAIT_S = 5.0
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
# Frames kept per snapshot (innermost first), and shown per group in the report.
MAX_FRAMES = 32
SHOWN_FRAMES = 12
# Groups shown in full in the headline before the rest are counted.
HEADLINE_GROUPS = 4


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
        r.seen_at, r.host, r.done = now, b.host, r.done or b.done
        if b.paused:
            if not r.paused:
                r.paused_since = now - max(0.0, b.paused_s)
            r.paused = b.paused
        elif r.paused:
            r.paused = ""
            self._progress(now)  # a pause ended: its time is not the job's stall
        if b.step > self.top_step:
            if self.top_step >= 0 and reached > self.top_at:
                self.intervals.append((reached - self.top_at) / (b.step - self.top_step))
            self.top_step, self.top_at = b.step, reached
        stall = self.stall
        if stall is not None and b.snapshot is not None and b.stall_id == stall.id:
            stall.snapshots[b.rank] = b.snapshot

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
        return any(
            r.paused and now - r.paused_since <= self.pause_limit_s for r in self.ranks.values()
        )

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
                # killed) say nothing about the job: unheard is not stalled.
                or self.last_seen < self.last_progress + bound
                or not self._answering(now)
                or self.paused(now)
                or any(r.done for r in self.ranks.values())
            ):
                return
            self.stall = Stall(
                self.first_stall_id + self.stalls, self.last_progress, now, self.top_step
            )
            self.stalls += 1
            return
        if stall.told:
            return
        answering = self._answering(now)
        waited = now - stall.asked_at >= SNAPSHOT_WAIT_S
        if not waited and not set(answering) <= set(stall.snapshots):
            return
        if not stall.snapshots:
            # Asked, and nobody answered: the link went with the question. Not a report of
            # where anyone is; asked again once ranks beat again without progress.
            self.stall = None
            return
        stall.headline, stall.report = self.words(stall, now)
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
        beat can; every beat asks again). Never later than the sweep that would act."""
        if self.level is Level.OFF or not self.ranks:
            return None
        stall = self.stall
        if stall is None:
            # On every beat call: O(1) checks first. A stall needs a beat past the bound and
            # a rank answering (none SILENT_S after the last beat, the latest of any rank's).
            bound = self.bound()
            if (
                bound is None
                or self.last_seen < self.last_progress + bound
                or now - self.last_seen >= SILENT_S
                or any(r.done for r in self.ranks.values())
            ):
                return None
            limit = self.pause_limit_s
            paused = [r.paused_since for r in self.ranks.values() if r.paused]
            # exactly at its end, never after (float rounding could make that a moment late)
            return max(paused) + limit if self.paused(now) else now
        if stall.told:
            return None  # until a rank moves (a beat)
        waiting = [
            r.seen_at + SILENT_S  # the moment it stops counting as answering
            for k, r in self.ranks.items()
            if now - r.seen_at < SILENT_S and k not in stall.snapshots
        ]
        return min([stall.asked_at + SNAPSHOT_WAIT_S, *waiting]) if waiting else now

    def _answering(self, now: float) -> list[int]:
        """The ranks that beat lately (the rest cannot answer: asked nothing of them)."""
        return [k for k, r in self.ranks.items() if now - r.seen_at < SILENT_S]

    # -- the report ------------------------------------------------------------------------
    def words(self, stall: Stall, now: float) -> tuple[str, str]:
        """The stall in one line (groups smallest first) and in full (each group's frames,
        the steps, what to do). Identical for every rank."""
        groups: dict[tuple[str, str, str], list[int]] = {}
        for rank in sorted(stall.snapshots):
            s = stall.snapshots[rank]
            groups.setdefault((s.where, s.call, s.via), []).append(rank)
        ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
        silent = sorted(set(range(self.world_size)) - set(stall.snapshots))
        parts = [self._group_text(ranks, stall.snapshots[ranks[0]]) for _, ranks in ordered]
        if len(parts) > HEADLINE_GROUPS:
            rest = len(parts) - HEADLINE_GROUPS
            parts = [*parts[:HEADLINE_GROUPS], f"{plural(rest, 'more place')}"]
        if silent:
            parts.append(f"no answer from {self._ranks_on(silent)}")
        head = f"stalled at step {stall.step} for {now - stall.since:.0f} s"
        headline = f"{head}: {'; '.join(parts)}"
        lines = [
            f"job '{self.job_id}' (cohort {self.cohort_id}): no rank reached a new step for "
            f"{now - stall.since:.0f} s (stall bound {self.bound() or 0:.0f} s)",
            "",
        ]
        for _, ranks in ordered:
            snap = stall.snapshots[ranks[0]]
            lines.append(f"{self._group_text(ranks, snap)}:")
            lines.extend(f"    {f}" for f in snap.frames[:SHOWN_FRAMES])
            if len(snap.frames) > SHOWN_FRAMES:
                lines.append(f"    ... {plural(len(snap.frames) - SHOWN_FRAMES, 'more frame')}")
        if silent:
            lines.append(
                f"no answer from {self._ranks_on(silent)} within {SNAPSHOT_WAIT_S:.0f} s "
                "(a stopped or dead process, or a lost host)"
            )
        by_step: dict[int, list[int]] = {}
        for rank, r in sorted(self.ranks.items()):
            by_step.setdefault(r.step, []).append(rank)
        steps = "; ".join(
            f"{_ranks_word(ranks)} at step {step} "
            f"({now - max(self.ranks[k].reached_at for k in ranks):.0f} s ago)"
            for step, ranks in sorted(by_step.items())
        )
        lines += ["", f"last steps: {steps}"]
        lines.append(
            "look first at the smallest group: the ranks that are somewhere the others are not"
        )
        return headline, "\n".join(lines)

    def _group_text(self, ranks: list[int], snap: Snapshot) -> str:
        return f"{self._ranks_on(ranks)} {snap.text()}"

    def _ranks_on(self, ranks: list[int]) -> str:
        hosts = sorted({self.hosts.get(r, "") for r in ranks} - {""})
        where = f" on {hosts[0]}" if len(hosts) == 1 else ""
        return f"{_ranks_word(ranks)}{where}"

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


def _ranks_word(ranks: list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {ranges.compress_capped(ranks)}"
