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
    asks_poked: int = -1  # Asks.made when the ask holders' calls were last woken
    # (kind, rank) of the upload asks long polls have passed on: told once, as on a stream
    polled: set[tuple[UploadKind, int]] = field(default_factory=set)
    timers: dict[str, tuple[float, asyncio.TimerHandle]] = field(default_factory=dict)

    def cancel(self, *labels: str) -> None:
        for label in labels or tuple(self.timers):
            entry = self.timers.pop(label, None)
            if entry is not None:
                entry[1].cancel()


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
        """Call `action(cohort)` at wall time `at` (LATE_S after): one timer per (cohort,
        label), moved when `at` changes."""
        tracked = self.of(cohort)
        held = tracked.timers.get(label)
        if held is not None:
            if held[0] == at:
                return
            held[1].cancel()

        def fire() -> None:
            tracked.timers.pop(label, None)
            action(cohort)

        delay = max(at - self.clock(), 0.0) + LATE_S
        tracked.timers[label] = (at, asyncio.get_running_loop().call_later(delay, fire))

    def close(self) -> None:
        for tracked in self._tracked.values():
            tracked.cancel()
        self._tracked.clear()
