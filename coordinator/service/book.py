"""The service's own bookkeeping per cohort: what it last decided, its timers, whether its
verdict is being stored. The store holds data; this is what the service derives and owns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from cohortgate.coordinator.decision.cohort import UploadKind
from cohortgate.coordinator.service.events import Progress
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.base import LiveCohort

Key = tuple[str, int]  # (job, round)

# A timer fires this long after its time: the loop's clock and the wall clock drift by a
# hair, and a decision made a hair early would only be made again.
LATE_S = 0.05


def key_of(cohort: LiveCohort) -> Key:
    return (cohort.job_id, cohort.round)


def ref_of(cohort: LiveCohort, rank: int, incarnation: str) -> UploadRef:
    return UploadRef(cohort.job_id, cohort.round, rank, incarnation)


@dataclass
class Tracked:
    """One cohort as the service tracks it, from its first join until its verdict is sent
    (or it is abandoned)."""

    reason: str = ""  # the last decision's reason
    reason_kind: str = ""  # the same with digits masked: logged when it changes
    recheck_at: float | None = None  # the last decision's: when it may change by itself
    # Decided, but held back from the ranks until the history has stored the verdict (at
    # most RECORD_WAIT_S): a rank re-joining a restarted coordinator must find it there.
    recording: bool = False
    # None: not being decided off the loop; False: it is; True: decide again when it returns
    deciding: bool | None = None
    progress: tuple[float, int, Progress] | None = None  # (made at, state version, event)
    asks_poked: int = -1  # AskBook.made when the ask holders' calls were last woken
    # (kind, rank) of the upload asks long polls have passed on: told once, as on a stream
    polled: set[tuple[UploadKind, int]] = field(default_factory=set)
    # What is due when, by label ("recheck", "asks", "record"): one loop timer per cohort,
    # at the earliest of them (Book.arm).
    due: dict[str, tuple[float, Callable[[], None]]] = field(default_factory=dict)
    timer: tuple[float, asyncio.TimerHandle] | None = None

    def cancel(self, *labels: str) -> None:
        for label in labels or tuple(self.due):
            self.due.pop(label, None)
        if not self.due and self.timer is not None:
            self.timer[1].cancel()
            self.timer = None


class Book:
    """Tracked cohorts by (job, round); entries go when their cohort stops waiting."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._tracked: dict[Key, Tracked] = {}

    def of(self, cohort: LiveCohort) -> Tracked:
        tracked = self._tracked.get(key_of(cohort))
        if tracked is None:
            tracked = self._tracked[key_of(cohort)] = Tracked()
        return tracked

    def get(self, cohort: LiveCohort) -> Tracked | None:
        return self._tracked.get(key_of(cohort))

    def drop(self, cohort: LiveCohort) -> None:
        tracked = self._tracked.pop(key_of(cohort), None)
        if tracked is not None:
            tracked.cancel()

    def arm(
        self, cohort: LiveCohort, label: str, at: float, action: Callable[[LiveCohort], None]
    ) -> None:
        """Call `action(cohort)` at wall time `at` (LATE_S after), one action per (cohort,
        label), moved when `at` changes. A cohort has one loop timer, at the earliest of its
        actions; when it fires, every action then due runs, earliest first."""
        tracked = self.of(cohort)
        held = tracked.due.get(label)
        if held is not None and held[0] == at:
            return
        tracked.due[label] = (at, lambda: action(cohort))
        self._wake(tracked)

    def _wake(self, tracked: Tracked) -> None:
        """The cohort's one timer, at its earliest due action (none: no timer)."""
        if not tracked.due:
            tracked.cancel()
            return
        earliest = min(at for at, _ in tracked.due.values())
        if tracked.timer is not None:
            if tracked.timer[0] == earliest:
                return
            tracked.timer[1].cancel()
        delay = max(earliest - self.clock(), 0.0) + LATE_S
        handle = asyncio.get_running_loop().call_later(delay, self._fire, tracked)
        tracked.timer = (earliest, handle)

    def _fire(self, tracked: Tracked) -> None:
        tracked.timer = None
        now = self.clock()
        ready = sorted((at, label) for label, (at, _) in tracked.due.items() if at <= now)
        for _, label in ready:
            entry = tracked.due.pop(label, None)  # an earlier action may have cancelled it
            if entry is not None:
                entry[1]()
        if tracked.due and tracked.timer is None:
            self._wake(tracked)

    def close(self) -> None:
        for tracked in self._tracked.values():
            tracked.cancel()
        self._tracked.clear()
