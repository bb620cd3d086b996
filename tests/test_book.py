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


def test_a_call_holds_all_its_members_until_another_call_takes_one() -> None:
    """service/calls.py: a waiting call looks once (its count), not per member, whether it
    still holds every member it joined; a rank another call took (a restart) is no longer
    its, and only then does it look member by member."""
    from cohortgate.coordinator.service.book import ref_of
    from cohortgate.coordinator.service.calls import Calls

    cohort = LiveCohort(CohortState("j", 1, 4, first_join_at=0.0))
    calls, mine, theirs = Calls(), asyncio.Event(), asyncio.Event()
    refs = [ref_of(cohort, r, f"i{r}") for r in range(3)]
    for ref in refs:
        assert not calls.hold(ref, mine, lambda: True)
    assert calls.holds_all(cohort, mine, 3)
    assert not calls.holds_all(cohort, mine, 4) and not calls.holds_all(cohort, theirs, 0)
    assert calls.hold(refs[1], theirs, lambda: True), "taken over: the old call is woken"
    assert mine.is_set() and not calls.holds_all(cohort, mine, 3)
    assert [r.rank for r in refs if calls.owns(r, mine)] == [0, 2]
    assert calls.holds_all(cohort, mine, 2) and calls.holds_all(cohort, theirs, 1)


def test_a_call_whose_ranks_joined_again_on_another_call_ends_superseded() -> None:
    """The same process joins again (a relay re-joins its group after a blip): the new
    call holds its ranks and gets the verdict; the old one ends, saying why, at once."""
    from cohortgate.coordinator.contract.errors import FailedPrecondition
    from cohortgate.coordinator.decision.verdict import Outcome, Verdict
    from cohortgate.coordinator.service.core import Coordinator
    from cohortgate.coordinator.service.events import UploadAsk
    from cohortgate.coordinator.state.base import JoinIntent
    from tests.helpers import manifest_of, member_of

    async def run() -> tuple[str, object]:
        coordinator = Coordinator()
        m = manifest_of()
        ranks = [member_of(0, m), member_of(1, m)]
        old = coordinator.join_group([JoinIntent("s", 0, r, 3) for r in ranks])
        assert isinstance(await anext(old), UploadAsk)
        new = coordinator.join_group([JoinIntent("s", 0, r, 3) for r in ranks])
        ask = await anext(new)  # the new call holds ranks 0 and 1 now, and is asked
        assert isinstance(ask, UploadAsk)
        with pytest.raises(FailedPrecondition) as ended:
            await asyncio.wait_for(anext(old), 5)
        coordinator.upload(ask.ref, m, m.signature())
        last = coordinator.join_group([JoinIntent("s", 0, member_of(2, m), 3)])
        joined = asyncio.ensure_future(anext(last))  # rank 2 joins: the cohort is complete
        verdict = await asyncio.wait_for(anext(new), 5)
        while not isinstance(verdict, Verdict):  # progress meanwhile
            verdict = await asyncio.wait_for(anext(new), 5)
        await asyncio.wait_for(joined, 5)
        coordinator.close()
        return str(ended.value), verdict

    said, verdict = asyncio.run(run())
    assert said == "rank(s) 0,1 joined again on another call; this call is superseded"
    assert isinstance(verdict, Verdict) and verdict.outcome is Outcome.FORMED
