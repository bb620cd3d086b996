"""Stall detection on the event loop: each Audit call's step marks update their cohort's
progress (decision/stall.py) and are answered at once; a timer (service/sweeper.py) looks at
a cohort when its rules say a sweep could act: it finds a cohort that stopped making
progress, asks its ranks for snapshots (in the answers to their next beats), and reports the
stall once its snapshots are in. Stalls are logged, counted and kept in the history (as audit
findings of kind "stalled" and "resumed"), shown on the status page.

Cheap per call: a dict update per rank; the report is built once per stall."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.stall import (
    STRAGGLERS_SHOWN,
    Beat,
    CohortProgress,
    StallAnswer,
    StallEvent,
    Straggler,
)
from cohortgate.coordinator.decision.verdict import AuditFinding
from cohortgate.coordinator.service.observers import Observer
from cohortgate.coordinator.service.sweeper import Sweeper
from cohortgate.coordinator.service.watched import Formed, Watched
from cohortgate.coordinator.state.base import VerdictStore

log = structlog.get_logger("cohortgate")

SWEEP_S = 1.0  # the upkeep (eviction, stragglers) at most this far apart
# Stragglers are found this often (a pass over every rank of every watched job: at 100k ranks
# tens of milliseconds, not to be paid on the event loop every second).
STRAGGLERS_EVERY_S = 10.0
# A cohort none of whose ranks beat for this long is forgotten.
IDLE_S = 600.0
MAX_WATCHED = 10_000


class Stalls:
    def __init__(
        self,
        options: FormationOptions,
        history: VerdictStore,
        observer: Observer,
        clock: Callable[[], float],
        formed: Formed | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.options, self.history, self.observer = options, history, observer
        self.clock, self.wall = clock, wall
        self.watched = Watched[CohortProgress](
            limit=MAX_WATCHED,
            room_idle_s=IDLE_S / 10,
            formed=formed,
            noun="step mark",
            participle="watched",
            sized=observer.metrics.watched_cohorts.set,
            evicted=lambda gone: self._count_stalled(),
        )
        self.cohorts = self.watched.cohorts
        self.stragglers: dict[str, list[Straggler]] = {}  # by cohort id, as last found
        self._stragglers_at = -STRAGGLERS_EVERY_S
        self.due = self.watched.due
        self.sweeper = Sweeper(
            "stall", SWEEP_S, self.sweep, lambda: bool(self.cohorts), self.due, clock
        )

    def beat(self, beats: list[Beat]) -> dict[str, StallAnswer]:
        """Add the step marks (validated, one job); the answer for each cohort they name."""
        now = self.clock()
        touched: dict[str, CohortProgress] = {}
        for b in beats:
            c = touched.get(b.cohort_id) or self._cohort(b, now)
            touched[b.cohort_id] = c
            c.beat(b, now)
        self.observer.metrics.step_marks.inc(len(beats))
        for k, c in touched.items():
            self._drain(c)
            self.due.set(k, c.due(now))
        self.sweeper.start()
        return {k: c.answer() for k, c in touched.items()}

    def _cohort(self, b: Beat, now: float) -> CohortProgress:
        def new(hosts: dict[int, str]) -> CohortProgress:
            made = CohortProgress(
                b.cohort_id,
                b.job_id,
                b.world_size,
                self.options.policies.for_job(b.job_id)["stall"],
                self.options.stall_after_for(b.job_id),
                self.options.pause_limit_s,
                # past any id a coordinator before this one gave (one per 1/256 s at most)
                first_stall_id=int(self.wall() * 256),
            )
            made.hosts.update(hosts)  # a rank that never beats is named with its host
            return made

        return self.watched.take(b.cohort_id, b.job_id, b.round, now, new)

    def _drain(self, c: CohortProgress) -> None:
        m = self.observer.metrics
        for e in c.new:
            if e.kind == "stalled":
                m.stalls.labels(e.level).inc()
                log.warning(
                    "cohort stalled",
                    job=e.job_id[:64],
                    cohort=e.cohort_id,
                    step=e.step,
                    level=e.level,
                    stalled_s=round(e.stalled_s, 1),
                    headline=e.headline,
                    report=e.report,
                )
            else:
                log.warning(
                    "cohort moved again",
                    job=e.job_id[:64],
                    cohort=e.cohort_id,
                    step=e.step,
                    stalled_s=round(e.stalled_s, 1),
                )
            self.history.record_audit(_finding(e))
        if c.new:  # a stall found or ended: the gauge changes (not a scan on every call)
            self._count_stalled()
        c.new.clear()

    # -- sweeping --------------------------------------------------------------------------
    def sweep(self) -> None:
        """The cohorts whose time came, and (`Watched.sweep`) those idle for IDLE_S; every
        STRAGGLERS_EVERY_S, the stragglers of every cohort are found again."""
        now = self.clock()

        def look(c: CohortProgress) -> float | None:
            c.sweep(now)
            self._drain(c)
            return c.due(now)

        self.watched.sweep(now, look, IDLE_S)
        if now - self._stragglers_at >= STRAGGLERS_EVERY_S:
            self._stragglers_at = now
            ratio = self.options.straggler_ratio
            found = {k: c.stragglers(ratio) for k, c in self.cohorts.items()}
            self.stragglers = {k: v for k, v in found.items() if v}
            self.observer.metrics.stragglers.set(sum(len(v) for v in found.values()))

    def _count_stalled(self) -> None:
        stalled = sum(1 for x in self.cohorts.values() if x.stall and x.stall.told)
        self.observer.metrics.stalled.set(stalled)

    def close(self) -> None:
        self.sweeper.close()

    # -- reading ---------------------------------------------------------------------------
    def status(self, shown: int = 100) -> list[dict[str, object]]:
        """One line per watched cohort, for /status.json and the status page: stalled
        first, then the most recently heard from."""
        now = self.clock()
        ordered = sorted(
            self.cohorts.values(), key=lambda c: (not (c.stall and c.stall.told), -c.last_seen)
        )
        out: list[dict[str, object]] = []
        for c in ordered[:shown]:
            stall = c.stall if c.stall and c.stall.told else None
            median = c.median_step_s()
            out.append(
                {
                    "job_id": c.job_id,
                    "cohort_id": c.cohort_id,
                    "level": str(c.level),
                    "ranks": c.world_size,
                    "step": c.top_step,
                    "median_step_s": None if median is None else round(median, 4),
                    "stall_after_s": c.bound(),
                    "since_progress_s": round(now - c.last_progress, 1),
                    "stragglers": [
                        s.text() for s in self.stragglers.get(c.cohort_id, [])[:STRAGGLERS_SHOWN]
                    ],
                    "stall": None
                    if stall is None
                    else {
                        "id": stall.id,
                        "step": stall.step,
                        "stalled_s": round(now - stall.since, 1),
                        "headline": stall.headline,
                        "report": stall.report,
                    },
                }
            )
        return out


def _finding(e: StallEvent) -> AuditFinding:
    return AuditFinding(
        job_id=e.job_id,
        cohort_id=e.cohort_id,
        step=e.step,
        kind=e.kind,
        level=e.level,
        headline=e.headline,
        report=e.report,
        at=e.at,
    )
