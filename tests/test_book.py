"""The service's one scheduler per cohort (service/book.py): each cohort has one loop timer,
at the earliest of its due actions (re-check the decision, re-ask an upload, stop waiting
for the record); when it fires, every action then due runs, earliest first."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from cohortgate.coordinator.decision.cohort import CohortState
from cohortgate.coordinator.service.book import Book
from cohortgate.coordinator.state.base import LiveCohort

pytestmark = pytest.mark.timeout(30)


async def _until(condition: Callable[[], bool], within: float) -> None:
    give_up = time.monotonic() + within
    while not condition():
        assert time.monotonic() < give_up, "never happened"
        await asyncio.sleep(0.01)


def test_one_timer_per_cohort_runs_what_is_due_earliest_first() -> None:
    async def main() -> None:
        book = Book(time.time)
        cohort = LiveCohort(CohortState("j", 1, 2, first_join_at=time.time()))
        ran: list[str] = []
        now = time.time()
        book.arm(cohort, "late", now + 2.0, lambda c: ran.append("late"))
        book.arm(cohort, "soon", now + 0.5, lambda c: ran.append("soon"))
        book.arm(cohort, "gone", now + 0.1, lambda c: ran.append("gone"))
        tracked = book.of(cohort)
        assert tracked.timer is not None and tracked.timer[0] == now + 0.1, "one, the earliest"
        tracked.cancel("gone")

        def soon(c: LiveCohort) -> None:  # moved earlier; it arms another action
            ran.append("soon")
            book.arm(c, "next", time.time() + 0.05, lambda c2: ran.append("next"))

        book.arm(cohort, "soon", now + 0.05, soon)
        assert tracked.timer is not None and tracked.timer[0] == now + 0.05
        await _until(lambda: "next" in ran, 1.5)
        assert ran == ["soon", "next"], "late is 2 s out; gone was cancelled"
        await _until(lambda: "late" in ran, 5.0)
        assert ran == ["soon", "next", "late"]
        assert tracked.timer is None and tracked.due == {}
        book.arm(cohort, "dropped", time.time() + 0.05, lambda c: ran.append("dropped"))
        book.drop(cohort)
        await asyncio.sleep(0.3)
        assert ran == ["soon", "next", "late"], "a dropped cohort's actions never run"

    asyncio.run(main())
