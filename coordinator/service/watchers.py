"""Status watchers: changes coalesced per job and fanned out on a tick, so that no number of
watchers can slow another job's formation.

A change marks its cohort dirty; at most once per `interval_s` (and never more than a
quarter of the loop's time: see `_next_tick`) the hub summarises each dirty cohort once
and hands the same summary object to every watcher of its job. A watcher keeps only the
latest summary per cohort: one that falls behind (a slow reader, a full stream) finds the
current state of each cohort that changed, never a backlog of every step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from cohortgate.coordinator.contract.errors import LimitExceeded
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.service.status import CohortSummary

Key = tuple[str, int]  # (job, round)

# The fan-out after a tick may take at most this share of the loop's wall time: the next
# tick waits (DUTY - 1) times as long as the last fan-out took, however short the interval.
DUTY = 8.0
# A watcher that has not taken its last tick's summaries this long after the tick (a
# client that stopped reading) no longer holds the next tick back; it finds the latest
# summaries whenever it reads again.
LAGGARD_S = 2.0


@dataclass(eq=False)
class _Watcher:
    job_id: str  # "" watches every job
    holder: str
    outbox: dict[Key, CohortSummary] = field(default_factory=dict)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    notified: bool = False  # handed a tick's summaries it has not taken yet


class WatchHub:
    """Watchers by job, the dirty cohorts since the last tick, and the tick's timer.
    `summarize(keys)` returns the current summary of each key still held."""

    def __init__(
        self,
        summarize: Callable[[list[Key]], list[CohortSummary]],
        limits: Limits,
        interval_s: float = 0.5,
    ) -> None:
        self.summarize = summarize
        self.limits = limits
        self.interval_s = interval_s
        self._by_job: dict[str, list[_Watcher]] = {}
        self._per_holder: dict[str, int] = {}
        self._dirty: set[Key] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._last_tick = float("-inf")
        self._fanout_started = 0.0
        self._fanout_left = 0  # watchers notified at the last tick and not yet drained
        self._fanout_s = 0.0  # how long the last fan-out took, tick to last drain
        self.closing = False

    @property
    def open(self) -> int:
        return sum(self._per_holder.values())

    def changed(self, key: Key) -> None:
        if not (self._by_job.get(key[0]) or self._by_job.get("")):
            return  # nobody watches this job
        self._dirty.add(key)
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_at(self._next_tick(loop.time()), self._tick)

    def _next_tick(self, now: float) -> float:
        """No sooner than `interval_s` after the last tick, nor before the last fan-out has
        been followed by (DUTY - 1) times its own length of other work."""
        if self._fanout_left:  # still fanning out: judge by how long it has taken so far
            self._fanout_s = max(self._fanout_s, now - self._fanout_started)
        return max(
            now,
            self._last_tick + self.interval_s,
            self._fanout_started + self._fanout_s * DUTY,
        )

    def _tick(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._fanout_left and now - self._fanout_started < LAGGARD_S:
            # The last fan-out is still going: wait for it.
            self._timer = loop.call_at(max(self._next_tick(now), now + 0.05), self._tick)
            return
        self._forget_laggards()
        keys, self._dirty = sorted(self._dirty), set()
        self._last_tick = self._fanout_started = loop.time()
        started = time.perf_counter()
        summaries = self.summarize(keys)
        by_job: dict[str, list[CohortSummary]] = {}
        for s in summaries:
            by_job.setdefault(s.job_id, []).append(s)
        for job, some in by_job.items():
            for w in [*self._by_job.get(job, ()), *self._by_job.get("", ())]:
                for s in some:
                    w.outbox[(s.job_id, s.round)] = s
                if not w.notified:
                    w.notified = True
                    self._fanout_left += 1
                w.event.set()
        self._fanout_s = time.perf_counter() - started
        if not self._fanout_left:
            self._fanout_s = 0.0

    def _forget_laggards(self) -> None:
        if not self._fanout_left:
            return
        for watchers in self._by_job.values():
            for w in watchers:
                w.notified = False
        self._fanout_left = 0

    def _drained(self, w: _Watcher) -> None:
        if w.notified:
            w.notified = False
            self._fanout_left -= 1
            if not self._fanout_left:
                self._fanout_s = asyncio.get_running_loop().time() - self._fanout_started

    async def watch(
        self, job_id: str, holder: str, snapshot: Callable[[], list[CohortSummary]]
    ) -> AsyncIterator[CohortSummary]:
        """`snapshot()` first, then each change of the job (of every job for ""), at most
        one summary per cohort per tick."""
        self._check_limits(holder)
        w = _Watcher(job_id, holder)
        self._by_job.setdefault(job_id, []).append(w)
        self._per_holder[holder] = self._per_holder.get(holder, 0) + 1
        try:
            for summary in snapshot():
                yield summary
            while not self.closing:
                await w.event.wait()
                w.event.clear()
                batch, w.outbox = list(w.outbox.values()), {}
                for summary in batch:
                    yield summary
                self._drained(w)
        finally:
            self._drained(w)
            self._by_job[job_id].remove(w)
            if not self._by_job[job_id]:
                del self._by_job[job_id]
            self._per_holder[holder] -= 1
            if not self._per_holder[holder]:
                del self._per_holder[holder]

    def _check_limits(self, holder: str) -> None:
        watching = self.open
        if watching >= self.limits.max_watchers:
            raise LimitExceeded(
                f"{watching} status watches are open, the limit max_watchers="
                f"{self.limits.max_watchers}; close one (or poll ListCohorts)"
            )
        mine = self._per_holder.get(holder, 0)
        if mine >= self.limits.max_watchers_per_token:
            raise LimitExceeded(
                f"this token holds {mine} status watches, the limit "
                f"max_watchers_per_token={self.limits.max_watchers_per_token}"
            )

    def close(self) -> None:
        self.closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for watchers in self._by_job.values():
            for w in watchers:
                w.event.set()
