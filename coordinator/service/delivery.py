"""Record, then send: a verdict reaches the ranks once the history has stored it (or after
RECORD_WAIT_S at most, unless the history is fenced: etcd's, where a verdict not stored is
never sent), so a rank whose call breaks as the coordinator dies re-joins its
successor and finds this verdict, not a new round it would wait in while the others formed.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

import structlog

from cohortgate.coordinator.service.book import Book
from cohortgate.coordinator.service.calls import Calls
from cohortgate.coordinator.service.observers import Observer
from cohortgate.coordinator.state.base import LiveCohort, VerdictRow, VerdictStore

log = structlog.get_logger("cohortgate")

# A verdict waits this long at most for the history to store it before the ranks get it.
# What it waits for is the verdict's gate (state/history.py: 1-2 ms at 16,384 ranks); the
# fallback stays because the wait is on a disk and another process's lock: a locked, full
# or hung history file must not hold a job back longer than this.
RECORD_WAIT_S = 1.0


class Delivery:
    def __init__(
        self,
        history: VerdictStore,
        observer: Observer,
        book: Book,
        calls: Calls,
        changed: Callable[[LiveCohort], None],
    ) -> None:
        self.history, self.observer, self.book = history, observer, book
        self.calls, self._changed = calls, changed
        # A verdict waited RECORD_WAIT_S for the history in vain, and none was stored since:
        # the next verdicts are sent without waiting.
        self._history_late = False

    def decided(self, cohort: LiveCohort) -> None:
        """The verdict is logged, stored, then sent to every rank."""
        verdict = cohort.verdict
        assert verdict is not None
        log.info(
            f"cohort {verdict.outcome.value}",
            job=cohort.job_id,
            round=cohort.round,
            reason=verdict.reason,
            cohort_id=verdict.cohort_id,
            cause=verdict.cause.value if verdict.cause else None,
            warnings=verdict.warnings,
        )
        self.observer.decided(cohort)
        history = self.history
        members = {m.rank: m.incarnation for m in cohort.state.members.values()}
        row = VerdictRow.of(verdict, members)
        stored = False  # by the time `record` returned
        if not history.fenced and (history.problem or self._history_late):
            # A degraded history, or one already late: not waited for (again). A fenced
            # one (etcd) always is: not stored, not sent.
            history.record(row)
            self.deliver(cohort)
        else:
            tracked = self.book.of(cohort)
            tracked.cancel()  # a decided cohort has no recheck or asks left
            tracked.recording = True
            loop = asyncio.get_running_loop()
            # Stored before `record` returned (the in-memory history, or a writer thread
            # that was quick): delivered here, without a timer or a trip through the loop.
            recording, lock = True, threading.Lock()

            def written() -> None:  # on the history's writer thread (or in `record`)
                nonlocal stored
                with lock:
                    if recording:
                        stored = True
                        return
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    loop.call_soon_threadsafe(self._stored, cohort)

            history.record(row, written)
            with lock:
                recording = False
            if not (stored or history.fenced):
                self.book.arm(cohort, "record", self.book.clock() + RECORD_WAIT_S, self._unrecorded)
        self._changed(cohort)
        if stored:
            self._stored(cohort)

    def recording(self, cohort: LiveCohort) -> bool:
        """Decided, and held back until the history stores the verdict?"""
        tracked = self.book.get(cohort)
        return tracked is not None and tracked.recording

    def _stored(self, cohort: LiveCohort) -> None:
        self._history_late = False
        self.deliver(cohort)

    def _unrecorded(self, cohort: LiveCohort) -> None:
        if self.recording(cohort):
            self._history_late = True  # until a verdict is stored again
            log.warning(
                "verdict sent before the history stored it",
                job=cohort.job_id,
                round=cohort.round,
                waited_s=RECORD_WAIT_S,
                advice="the history file is slow or refuses writes; the record is retried",
            )
            self.deliver(cohort)

    def deliver(self, cohort: LiveCohort) -> None:
        """The verdict goes to every rank waiting on it, another launch's included; the
        service stops tracking the cohort."""
        self.book.drop(cohort)
        self.calls.poke_all(cohort)
