"""A rank that leaves before the verdict: its call ended (admission), or it ended unseen
before a complete cohort is decided (deciding). One place for both, so neither calls the
other back: its rank is freed for a restarted process, its asks go to others, and the round
is abandoned when no rank is left."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from cohortgate.coordinator.decision.cohort import Member
from cohortgate.coordinator.service.book import Book
from cohortgate.coordinator.service.calls import Calls
from cohortgate.coordinator.service.observers import Observer
from cohortgate.coordinator.state.base import CohortStore, LiveCohort

log = structlog.get_logger("cohortgate")


class Departures:
    def __init__(
        self,
        store: CohortStore,
        observer: Observer,
        book: Book,
        calls: Calls,
        changed: Callable[[LiveCohort], None],
    ) -> None:
        self.store, self.observer, self.book, self.calls = store, observer, book, calls
        self._changed = changed

    def depart(self, cohort: LiveCohort, member: Member) -> None:
        """`member` left before the verdict: its rank is free, its asks go to others; the
        round is abandoned when no rank is left."""
        if not cohort.state.holds(member):
            return  # an intruder (another launch), or already replaced
        successors = self.store.leave(cohort, member)
        self.calls.forget(cohort, member)
        self.observer.departed()
        self._changed(cohort)
        log.info("rank left before the verdict", **where(cohort, member))
        for successor in successors:
            self.calls.poke(cohort, successor)
        if self.store.abandon(cohort):
            self.book.drop(cohort)
            self.observer.abandoned()
            self._changed(cohort)
            log.info(
                "round abandoned",
                job=cohort.job_id,
                round=cohort.round,
                reason="every rank left before a verdict; the next join opens a new round",
            )


def where(cohort: LiveCohort, member: Member) -> dict[str, object]:
    """A member's log context."""
    return {
        "job": cohort.job_id,
        "round": cohort.round,
        "rank": member.rank,
        "host": member.host,
        "incarnation": member.incarnation,
    }
