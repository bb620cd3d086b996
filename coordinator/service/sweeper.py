"""When the watched cohorts next need a look, and one timer on the event loop that looks at
them then: the audits' and the stalls'. Each cohort's rules say when a sweep could next change
its outcome if no call comes first (`CohortAudits.due`, `CohortProgress.due`: pure functions of
its state and the time); every call that changes a cohort asks again. A sweep looks only at the
cohorts due, so its work follows the cohorts whose time came, not the cohorts watched; and the
timer wakes at the earliest of those times (at the latest every `every_s`, for the upkeep that
runs across cohorts: eviction, stragglers)."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable

import structlog

log = structlog.get_logger("cohortgate")

# The soonest a timer fires again after a sweep (a rule whose time came but that did not act,
# by a rounding of its bound, is looked at again this much later, not in a tight loop).
MIN_WAIT_S = 0.01


class Due:
    """When each key next needs a look, earliest first: a heap whose replaced entries are
    dropped as they surface (and the heap rebuilt when they pile up)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._at: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._at)

    def set(self, key: str, at: float | None) -> None:
        """`key` is due at `at` (None: only a call can change it; not due)."""
        if at is None:
            self._at.pop(key, None)
            return
        if self._at.get(key) == at:
            return
        self._at[key] = at
        heapq.heappush(self._heap, (at, key))
        if len(self._heap) > 2 * len(self._at) + 64:
            self._heap = [(a, k) for k, a in self._at.items()]
            heapq.heapify(self._heap)

    def pop(self, now: float) -> list[str]:
        """The keys due by `now`, earliest first; they leave the table (a look sets them
        again)."""
        out = []
        heap, at = self._heap, self._at
        while heap and heap[0][0] <= now:
            when, key = heapq.heappop(heap)
            if at.get(key) == when:
                del at[key]
                out.append(key)
        return out

    def next_at(self) -> float | None:
        heap, at = self._heap, self._at
        while heap and at.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None


class Sweeper:
    """A timer on the loop for one kind of watching: `sweep()` at the earliest due time of
    `due` (read on `clock`), and at least every `every_s` while `busy()`; each call that
    changed something calls `start()`, which brings the timer forward if it must."""

    def __init__(
        self,
        what: str,
        every_s: float,
        sweep: Callable[[], None],
        busy: Callable[[], bool],
        due: Due,
        clock: Callable[[], float],
    ) -> None:
        self.what, self.every_s, self.sweep, self.busy = what, every_s, sweep, busy
        self.due, self.clock = due, clock
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    def start(self) -> None:
        """From the loop: the timer set for the next look, sooner if a cohort came due."""
        if self._closed:
            return
        loop = asyncio.get_running_loop()
        wait = self.every_s
        nxt = self.due.next_at()
        if nxt is not None:
            wait = min(wait, max(MIN_WAIT_S, nxt - self.clock()))
        when = loop.time() + wait
        if self._timer is not None:
            if self._timer.when() <= when:
                return
            self._timer.cancel()
        self._timer = loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._timer = None
        try:
            self.sweep()
        except Exception:  # a bug: logged whole; the next sweep goes on
            log.exception(f"{self.what} sweep failed")
        if self.busy():
            self.start()

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
