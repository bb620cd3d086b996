"""The coordinator's service on one event loop, behind one facade.

`Coordinator` wires the parts, each in its own module:

- admission.py: joins enter the store; each rank's call waits for progress, asks, verdict
- deciding.py:  the one place `judge()` is called; the cohort's timers come from its decision
- delivery.py:  record, then send: the verdict reaches the ranks once the history has it
- uploads.py:   manifests and per-tensor digests the coordinator asked for
- watchers.py:  status streams, fanned out on a tick so no watcher slows formation
- book.py, calls.py: what the service tracks per cohort, and the open calls of waiting ranks

The store (`state.base.CohortStore`) holds the data; it never decides.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Sequence

from cohortgate.coordinator.contract.errors import Unavailable
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.contract.manifest import ManifestLike
from cohortgate.coordinator.decision.audit import Answer, RankAudit
from cohortgate.coordinator.decision.cohort import UploadKind
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.stall import Beat
from cohortgate.coordinator.decision.verdict import Outcome
from cohortgate.coordinator.service.admission import Admission
from cohortgate.coordinator.service.audits import Audits
from cohortgate.coordinator.service.book import Book
from cohortgate.coordinator.service.calls import Calls
from cohortgate.coordinator.service.cohorts import Cohorts
from cohortgate.coordinator.service.deciding import OFFLOAD_ABOVE, Decider
from cohortgate.coordinator.service.delivery import Delivery
from cohortgate.coordinator.service.departures import Departures
from cohortgate.coordinator.service.events import JoinEvent, Progress
from cohortgate.coordinator.service.observers import Observer
from cohortgate.coordinator.service.stalls import Stalls
from cohortgate.coordinator.service.status import CohortSummary, summarize
from cohortgate.coordinator.service.uploads import Uploads
from cohortgate.coordinator.service.watchers import WatchHub
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.backends import open_verdicts
from cohortgate.coordinator.state.base import CohortStore, JoinIntent, LiveCohort, VerdictStore

# Listings of up to this many cohorts are exact; larger ones may be 0.25 s stale.
LISTING_EXACT_UP_TO = 64


class Coordinator:
    """Joins, uploads and status over a `CohortStore` (memory by default) and a
    `VerdictStore` (`history`: memory by default)."""

    def __init__(
        self,
        options: FormationOptions | None = None,
        *,
        progress_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        observer: Observer | None = None,
        limits: Limits | None = None,
        store: CohortStore | None = None,
        history: VerdictStore | None = None,
        offload_above: int = OFFLOAD_ABOVE,
        watch_interval_s: float = 0.5,
    ) -> None:
        self.options = options or FormationOptions()
        self.observer = observer or Observer()
        self.limits = limits or Limits()
        self.history = history or open_verdicts(None)
        self.history.listeners.append(self.observer.history_failed)
        self.store = store or Cohorts(clock, self.history.last_round, self.limits)
        self.clock = clock
        self.book = Book(clock)
        self.calls = Calls()
        self.watchers = WatchHub(self._summaries_of, self.limits, watch_interval_s)
        # One pipeline, each part handed the ones after it: admission -> deciding ->
        # delivery (record, then send); a rank that leaves -> departures.
        self.delivery = Delivery(self.history, self.observer, self.book, self.calls, self._changed)
        self.departures = Departures(
            self.store, self.observer, self.book, self.calls, self._changed
        )
        self.decider = Decider(
            self.store,
            self.options,
            clock,
            self.observer,
            self.book,
            self.calls,
            delivery=self.delivery,
            departures=self.departures,
            offload_above=offload_above,
        )
        self.admission = Admission(
            self.store,
            self.history,
            self.options,
            self.observer,
            clock,
            self.calls,
            self.book,
            progress_interval_s=progress_interval_s,
            decider=self.decider,
            delivery=self.delivery,
            departures=self.departures,
            changed=self._changed,
        )
        self.uploads = Uploads(self.store, self.observer, self.decider)
        self.audits = Audits(self.options, self.history, self.observer, clock, self._formed)
        self.stalls = Stalls(self.options, self.history, self.observer, clock, self._formed)
        # A large listing (status page, ListCohorts) is summarised at most this often:
        # a client polling in a loop must not cost the loop O(cohorts) per call.
        self._listing: dict[str, tuple[float, int, list[CohortSummary]]] = {}

    @property
    def offload_above(self) -> int:
        return self.decider.offload_above

    @offload_above.setter
    def offload_above(self, value: int) -> None:
        self.decider.offload_above = value

    # -- joining -----------------------------------------------------------------------
    async def join(
        self,
        intent: JoinIntent,
        alive: Callable[[], bool] = lambda: True,
        on_gone: Callable[[Callable[[], None]], None] | None = None,
    ) -> AsyncIterator[JoinEvent]:
        """Join and wait. `alive` says whether the caller's call is still open, and `on_gone`
        registers a callback for when it closes: a cancelled call must free its rank even
        when the cancellation overtook the join itself."""
        async for event in self.admission.join_group([intent], alive, on_gone):
            yield event

    def join_group(
        self,
        intents: list[JoinIntent],
        alive: Callable[[], bool] = lambda: True,
        on_gone: Callable[[Callable[[], None]], None] | None = None,
    ) -> AsyncIterator[JoinEvent]:
        """Join several ranks of one job (a relay's node) and wait as one: one wake-up, one
        progress event and one verdict for all of them. `join` is a group of one."""
        return self.admission.join_group(intents, alive, on_gone)

    async def poll(
        self,
        intents: list[JoinIntent],
        alive: Callable[[], bool] = lambda: True,
        on_gone: Callable[[Callable[[], None]], None] | None = None,
    ) -> JoinEvent:
        """JoinPoll: join_group as one answer (see Admission.poll)."""
        return await self.admission.poll(intents, alive, on_gone)

    def evaluate(self, cohort: LiveCohort) -> None:
        """Decide `cohort` again (after a change, or when its recheck time comes)."""
        self.decider.evaluate(cohort)

    def progress(self, cohort: LiveCohort) -> Progress:
        return self.admission.progress(cohort)

    # -- uploads -----------------------------------------------------------------------
    def wants_upload(self, ref: UploadRef, kind: UploadKind, claimed: bytes, size: int) -> bool:
        return self.uploads.wants(ref, kind, claimed, size)

    def upload(self, ref: UploadRef, manifest: ManifestLike, claimed: bytes, size: int = 0) -> None:
        self.uploads.manifest(ref, manifest, claimed, size)

    async def upload_digests(self, ref: UploadRef, digests: list[bytes]) -> None:
        await self.uploads.digests(ref, digests)

    def upload_files(self, ref: UploadRef, files: list[tuple[str, bytes]]) -> None:
        self.uploads.files(ref, files)

    # -- audits during training ----------------------------------------------------------
    def audit(self, audits: list[RankAudit], beats: Sequence[Beat] = ()) -> list[Answer]:
        """Rank audits and step marks of formed cohorts (one job): what each cohort's ranks
        are told now (their audits' answer and their stall's). A standby takes none (it
        names the leader, as for joins)."""
        refusal = self.admission.refusal()
        if refusal is not None:
            raise refusal
        answers = {a.cohort_id: a for a in self.audits.submit(audits)} if audits else {}
        if beats:
            level = str(self.options.policies.for_job(beats[0].job_id)["audit"])
            for cohort_id, stall in self.stalls.beat(list(beats)).items():
                known = answers.get(cohort_id) or self.audits.answer_for(cohort_id)
                answers[cohort_id] = (
                    Answer(cohort_id, level, stall=stall)
                    if known is None
                    else dataclasses.replace(known, stall=stall)
                )
        return list(answers.values())

    def _formed(self, job_id: str, round_: int) -> tuple[str, dict[int, str]] | None:
        """The cohort id a held (job, round) formed as, and its ranks' hosts; None when the
        round is not held (past --job-retention, a restart) or did not form."""
        live = self.store.find(job_id, round_)
        if live is None or live.verdict is None or live.verdict.outcome is not Outcome.FORMED:
            return None
        return live.verdict.cohort_id, {r: m.host for r, m in live.state.members.items()}

    # -- status --------------------------------------------------------------------------
    def history_problem(self) -> str:
        """Why the verdict history is degraded ("" when it is not); updates its gauges."""
        problem = self.history.problem
        self.observer.history_state(problem, self.history.spooled)
        return problem

    def cohorts(self, job_id: str = "") -> list[LiveCohort]:
        """Every cohort held (waiting and recently decided), optionally of one job."""
        return self.store.cohorts(job_id)

    def find(self, job_id: str, round_: int = 0) -> LiveCohort | None:
        return self.store.find(job_id, round_)

    def summary(self, cohort: LiveCohort, now: float) -> CohortSummary:
        return summarize(cohort, now, self.options, self.book.get(cohort))

    def summaries(self, job_id: str = "") -> list[CohortSummary]:
        now = self.clock()
        cached = self._listing.get(job_id)
        if cached is not None and cached[1] > LISTING_EXACT_UP_TO and now < cached[0]:
            return cached[2]
        started = time.perf_counter()
        out = [self.summary(c, now) for c in self.cohorts(job_id)]
        if len(self._listing) > 64:
            self._listing.clear()
        # Reused for 0.25 s, or 20 times as long as it took to make (with its encoding,
        # about 10% of the loop for a client that lists in a tight loop).
        fresh_until = now + max(0.25, 20 * (time.perf_counter() - started))
        self._listing[job_id] = (fresh_until, len(out), out)
        oldest = max((s.age_s for s in out if s.state == "waiting"), default=0.0)
        self.observer.metrics.oldest_waiting.set(oldest)
        return out

    def _summaries_of(self, keys: list[tuple[str, int]]) -> list[CohortSummary]:
        now = self.clock()
        found = (self.find(job, round_) for job, round_ in keys)
        return [self.summary(c, now) for c in found if c is not None]

    def watch(self, job_id: str = "", holder: str = "") -> AsyncIterator[CohortSummary]:
        """Every matching cohort now, then each one again when it changes: at most once per
        watch interval, the latest state only (see service/watchers.py). `holder` names who
        watches (a token's scope) for the per-token limit."""
        return self.watchers.watch(job_id, holder, lambda: self.summaries(job_id))

    def _changed(self, cohort: LiveCohort) -> None:
        self.watchers.changed((cohort.job_id, cohort.round))

    # -- standing by, shutdown ---------------------------------------------------------
    def stand_by(self, refusal: Callable[[], Unavailable]) -> None:
        """Admit nothing and deliver nothing: every waiting join ends with `refusal()` (a
        standby names the leader), and so does every join until `lead()`."""
        self.admission.refusal = refusal
        self.decider.closing = True
        self.calls.wake_all()

    def lead(self, gate: Callable[[], Unavailable | None] = lambda: None) -> None:
        """Admit again (while `gate()` says nothing against it), with nothing held from
        before: jobs decided while another replica led are read from the verdict history,
        not from this replica's memory."""
        self.decider.closing = False
        self.admission.refusal = gate
        self.store.evict(-1.0)

    def close(self) -> None:
        """Wake every waiting join so it ends with UNAVAILABLE and its agent retries."""
        shutting = Unavailable(
            "the coordinator is shutting down; the agent will re-join its successor"
        )
        self.stand_by(lambda: shutting)
        self.book.close()
        self.watchers.close()
        self.audits.close()
        self.stalls.close()
