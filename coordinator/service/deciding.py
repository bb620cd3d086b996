"""Deciding: the one place the service calls `judge()` (on the loop for a small cohort, in a
worker process for a heavy one), keeps the result in the store, and arms the cohort's timers
from it: the decision's own `recheck_at`, and re-asking a silent uploader."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import structlog

from cohortgate.coordinator.decision import asks
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import Decision, Verdict
from cohortgate.coordinator.service.book import Book
from cohortgate.coordinator.service.calls import Calls
from cohortgate.coordinator.service.delivery import Delivery
from cohortgate.coordinator.service.departures import Departures
from cohortgate.coordinator.service.observers import Observer
from cohortgate.coordinator.state.base import CohortStore, LiveCohort

log = structlog.get_logger("cohortgate")
_DIGITS = re.compile(r"\d+")

# An upload asked for and not received within this time is asked of another rank of the
# same class: a 1M-entry manifest takes ~1 s to encode and send; 5 s is a rank not answering.
ASK_AGAIN_S = 5.0

# Above this many layout pieces (or manifest entries, when classes differ) a complete
# cohort is decided in a worker process: ~0.1 s of the loop's time at most.
OFFLOAD_ABOVE = 20_000

_WORKERS: ProcessPoolExecutor | None = None


def _workers() -> ProcessPoolExecutor:
    """A process for heavy decisions: a thread would hold the GIL for the whole check (a
    minute for 1M pieces) and starve the event loop. Spawned, not forked: the gRPC server's
    threads must not be copied. One decision per process: its memory (a diff of a
    million entries) goes back to the system with it."""
    global _WORKERS  # noqa: PLW0603 (one pool per process, made on first use)
    if _WORKERS is None:
        _WORKERS = ProcessPoolExecutor(
            max_workers=1, mp_context=mp.get_context("spawn"), max_tasks_per_child=1
        )
    return _WORKERS


class Decider:
    """Decides cohorts and keeps them moving: `evaluate` after every change; the decided
    ones go to delivery (record-then-send), members whose calls ended to departures."""

    def __init__(
        self,
        store: CohortStore,
        options: FormationOptions,
        clock: Callable[[], float],
        observer: Observer,
        book: Book,
        calls: Calls,
        *,
        delivery: Delivery,
        departures: Departures,
        offload_above: int = OFFLOAD_ABOVE,
    ) -> None:
        self.store, self.options, self.clock = store, options, clock
        self.observer, self.book, self.calls = observer, book, calls
        self.delivery, self.departures = delivery, departures
        self.offload_above = offload_above
        self.closing = False
        self._tasks: set[asyncio.Task[None]] = set()

    def evaluate(self, cohort: LiveCohort) -> None:
        """Decide `cohort` now (or in a worker, when heavy) and act on the decision."""
        if cohort.settled:
            return
        self._drop_ended_calls(cohort)
        if cohort.settled:
            return  # every rank's call had ended: abandoned
        if self._heavy(cohort):
            self._decide_off_loop(cohort)
            return
        now = self.clock()
        decision, verdict = judge(cohort.state, now, self.options)
        self._judged(cohort, decision, verdict, now)

    def _drop_ended_calls(self, cohort: LiveCohort) -> None:
        """Before a complete cohort is decided: members whose calls have ended (the
        cancel reached grpc, the done callback is still queued) leave first, so a cohort
        never forms with a process that is gone."""
        state = cohort.state
        if not state.complete or not self.calls.any_ended(cohort):
            return  # one look per call; members only when a call has ended
        for member in [m for m in state.members.values() if not self.calls.answers(cohort, m)]:
            self.departures.depart(cohort, member)

    def _heavy(self, cohort: LiveCohort) -> bool:
        """A complete cohort whose decision walks many layout pieces (coverage) or diffs
        large manifests: decided in a worker, so the loop keeps serving every other job
        (a 1M-piece coverage check takes a minute)."""
        state = cohort.state
        if cohort.settled or not state.complete:
            return False
        if state.pieces > self.offload_above:
            return True
        return len(state.classes) > 1 and any(
            len(m) > self.offload_above for m in state.manifests.values()
        )

    def _decide_off_loop(self, cohort: LiveCohort) -> None:
        tracked = self.book.of(cohort)
        if tracked.deciding is not None:
            tracked.deciding = True  # decide again once the running decision returns
            return
        tracked.deciding = False
        task = asyncio.get_running_loop().create_task(self._off_loop(cohort))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _off_loop(self, cohort: LiveCohort) -> None:
        tracked = self.book.of(cohort)
        try:
            while not cohort.settled and not self.closing:
                tracked.deciding = False
                seen = cohort.state.fingerprint()
                snapshot, now = cohort.state.snapshot(), self.clock()
                self.observer.metrics.offloaded.inc()
                decision, verdict = await asyncio.get_running_loop().run_in_executor(
                    _workers(), judge, snapshot, now, self.options
                )
                if cohort.state.fingerprint() != seen or tracked.deciding:
                    continue  # a join, a departure or an upload meanwhile: decide again
                self._judged(cohort, decision, verdict, now)
                return
        finally:
            tracked.deciding = None

    def _judged(
        self, cohort: LiveCohort, decision: Decision, verdict: Verdict | None, now: float
    ) -> None:
        """Keep the decision in the store; then the verdict's fan-out, or the waiting
        cohort's timers and asks."""
        if not self.store.apply(cohort, decision, verdict, now):
            return
        if cohort.verdict is not None:
            self.delivery.decided(cohort)
            return
        tracked = self.book.of(cohort)
        tracked.recheck_at = decision.recheck_at
        # Logged when the kind of wait changes, not on every join ("[12/16 ranks joined]"
        # and "[13/16 ranks joined]" are the same wait).
        tracked.reason = decision.reason
        kind = _DIGITS.sub("#", decision.reason)
        if kind != tracked.reason_kind:
            tracked.reason_kind = kind
            log.info("waiting", job=cohort.job_id, round=cohort.round, reason=decision.reason)
        if cohort.asks.made != tracked.asks_poked:
            # New asks: their holders' calls pass them on (not on every join: a holder's
            # call would otherwise wake once per call that joins after it).
            tracked.asks_poked = cohort.asks.made
            for holder in asks.holders(cohort.asks, cohort.state):
                self.calls.poke(cohort, holder)
        # The one moment the decision can change by itself; evaluated again then.
        if decision.recheck_at is not None:
            self.book.arm(cohort, "recheck", decision.recheck_at, self.evaluate)
        oldest = asks.oldest(cohort.asks)
        if oldest is not None:
            self.book.arm(cohort, "asks", oldest + ASK_AGAIN_S, self._ask_again)

    def _ask_again(self, cohort: LiveCohort) -> None:
        """Unanswered asks go to another rank of their class."""
        for member in self.store.rotate_asks(cohort, ASK_AGAIN_S):
            log.info(
                "asking another rank",
                job=cohort.job_id,
                round=cohort.round,
                rank=member.rank,
                reason=f"no upload within {ASK_AGAIN_S:g}s from the rank asked before",
            )
            self.calls.poke(cohort, member)
        self.evaluate(cohort)
