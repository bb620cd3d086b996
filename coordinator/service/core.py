"""The coordinator's core on one event loop: joins wait here until their cohort's verdict."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import structlog

from coordinator.contract import ranges
from coordinator.contract.digests import combine_uploaded
from coordinator.contract.errors import (
    AlreadyHeld,
    FailedPrecondition,
    Unavailable,
)
from coordinator.contract.limits import Limits
from coordinator.contract.manifest import ManifestLike
from coordinator.decision.cohort import Member, UploadKind
from coordinator.decision.formation import Decision, FormationOptions
from coordinator.decision.report import Verdict, judge
from coordinator.service.observers import Observer
from coordinator.service.status import CohortSummary, summarize
from coordinator.service.watchers import WatchHub
from coordinator.state.asks import UploadRef
from coordinator.state.base import (
    CohortStore,
    InvalidUpload,
    JoinIntent,
    JoinResult,
    LiveCohort,
)
from coordinator.state.memory import MemoryStore


def ref_of(cohort: LiveCohort, member: Member) -> UploadRef:
    return UploadRef(cohort.job_id, cohort.round, member.rank, member.incarnation)


log = structlog.get_logger("cohortgate")
_DIGITS = re.compile(r"\d+")


@dataclass(frozen=True)
class Progress:
    job_id: str
    round: int
    joined: int
    expected: int
    missing_ranks: str
    message: str
    deadline_in_s: float


@dataclass(frozen=True)
class UploadAsk:
    """Tell the rank of `ref` to upload `kind` (its manifest, its per-tensor digests)."""

    kind: UploadKind
    key: bytes  # the signature or weights digest the upload is for
    ref: UploadRef


JoinEvent = Progress | UploadAsk | Verdict
# An upload asked for and not received within this time is asked of another rank of the
# same class: a 1M-entry manifest takes ~1 s to encode and send; 5 s is a rank not answering.
ASK_AGAIN_S = 5.0

# Above this many layout pieces (or manifest entries, when classes differ) a complete
# cohort is decided in a worker thread: ~0.1 s of the loop's time at most.
OFFLOAD_ABOVE = 20_000
# A verdict waits this long at most for the history to store it before the ranks get it
# (a commit takes milliseconds; a locked or slow disk must not hold a job back longer).
RECORD_WAIT_S = 1.0
# Digest uploads with more entries are combined in a worker thread (see upload_digests).
INLINE_DIGESTS = 10_000


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


# Listings of up to this many cohorts are exact; larger ones may be 0.25 s stale.
LISTING_EXACT_UP_TO = 64

# Up to this world size every progress event is exact; above, it may be 0.25 s stale.
PROGRESS_EXACT_UP_TO = 1024


class Coordinator:
    """The cohort store plus waiting: one asyncio.Event per waiting rank, timers for
    deadlines. `store` defaults to memory; any `CohortStore` serves."""

    def __init__(
        self,
        options: FormationOptions | None = None,
        *,
        progress_interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        observer: Observer | None = None,
        limits: Limits | None = None,
        store: CohortStore | None = None,
        offload_above: int = OFFLOAD_ABOVE,
        watch_interval_s: float = 0.5,
    ) -> None:
        self.options = options or FormationOptions()
        self.observer = observer or Observer()
        history = self.observer.history
        self.store = store or MemoryStore(
            self.options,
            clock,
            history.last_round if history is not None else lambda _: 0,
            limits,
        )
        self.clock = clock
        self.progress_interval_s = progress_interval_s
        # The event each waiting rank's call sleeps on, by the rank's incarnation and round.
        self._pokes: dict[UploadRef, asyncio.Event] = {}
        # Whether each waiting rank's call is still open (its `alive`), by the same key.
        self._alive: dict[UploadRef, Callable[[], bool]] = {}
        self._timers: dict[tuple[str, int, str], asyncio.TimerHandle] = {}
        self._progress: dict[tuple[str, int], tuple[float, int, Progress]] = {}
        self._closing = False
        # A verdict waited RECORD_WAIT_S for the history in vain, and none was stored since:
        # the next verdicts are sent without waiting.
        self._history_late = False
        # Cohorts being decided in a worker thread: True when they must be decided again.
        self._deciding: dict[tuple[str, int], bool] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.offload_above = offload_above
        self.limits = limits or Limits()
        self.watchers = WatchHub(self._summaries_of, self.limits, watch_interval_s)
        # A large listing (status page, ListCohorts) is summarised at most this often:
        # a client polling in a loop must not cost the loop O(cohorts) per call.
        self._listing: dict[str, tuple[float, int, list[CohortSummary]]] = {}

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
        async for event in self.join_group([intent], alive, on_gone):
            yield event

    async def join_group(
        self,
        intents: list[JoinIntent],
        alive: Callable[[], bool] = lambda: True,
        on_gone: Callable[[Callable[[], None]], None] | None = None,
    ) -> AsyncIterator[JoinEvent]:
        """Join several ranks of one job (a relay's node) and wait as one: one wake-up, one
        progress event and one verdict for all of them. `join` is a group of one."""
        if self._closing:
            raise Unavailable("the coordinator is shutting down; retry against its successor")
        poke = asyncio.Event()
        admitted = self._replayed_from_history(intents[0]) or self._admit(intents, poke, alive)
        if isinstance(admitted, Verdict):
            yield admitted
            return
        cohort, held = admitted
        try:
            if on_gone is not None:
                on_gone(poke.set)
            self.evaluate(cohort)
            self._changed(cohort)
            async for event in self._wait(cohort, held, poke, intents, alive):
                yield event
        finally:
            self._release(cohort, held, poke)

    def _replayed_from_history(self, first: JoinIntent) -> Verdict | None:
        """After a restart (or once the job left memory): a rank of a decided cohort that
        re-joins with its incarnation gets that verdict back, not a new round."""
        history = self.observer.history
        if history is None or self.store.holds(first.job_id):
            return None
        stored = history.verdict_of(first.job_id, first.member.incarnation)
        if stored is not None:
            log.info("verdict replayed from history", job=first.job_id)
        return stored

    def _admit(
        self, intents: list[JoinIntent], poke: asyncio.Event, alive: Callable[[], bool]
    ) -> Verdict | tuple[LiveCohort, list[tuple[UploadRef, Member]]]:
        """Every intent joins (or all are undone): the cohort and the members now waiting on
        `poke`, or the verdict of a decided round the same incarnation took part in."""
        held: list[tuple[UploadRef, Member]] = []
        cohort: LiveCohort | None = None
        try:
            for intent in intents:
                result = self._join_store(intent)
                if result.replayed:
                    if held:
                        raise FailedPrecondition(
                            f"rank {intent.member.rank} of this group took part in round "
                            f"{result.cohort.round}, which is decided, while the others "
                            "join the open round: re-join them separately"
                        )
                    assert result.cohort.verdict is not None
                    log.info(
                        "a restarted process takes its predecessor's place in the decided "
                        "round: verdict replayed"
                        if result.successor
                        else "verdict replayed",
                        job=result.cohort.job_id,
                        round=result.cohort.round,
                        rank=result.member.rank,
                    )
                    return result.cohort.verdict
                if cohort is not None and result.cohort is not cohort:
                    raise FailedPrecondition("the members of one group joined different rounds")
                cohort, member = result.cohort, result.member
                ref = ref_of(cohort, member)
                superseded = self._pokes.get(ref)
                if superseded is not None:
                    superseded.set()
                elif result.intruder:
                    self.observer.metrics.joins.inc()  # never a member: not waiting
                else:
                    self.observer.joined(result.opened)
                self._pokes[ref] = poke
                self._alive[ref] = alive
                held.append((ref, member))
                log.debug(
                    "rank joined",
                    job=cohort.job_id,
                    round=cohort.round,
                    rank=member.rank,
                    host=member.host,
                    signature=member.signature.hex()[:12],
                )
        except BaseException:
            if cohort is not None:
                self._release(cohort, held, poke)
            raise
        assert cohort is not None
        return cohort, held

    def _join_store(self, intent: JoinIntent) -> JoinResult:
        """The store's join; a rank held by a call that has ended (its cancel reached grpc,
        its done callback has not run yet: a restart racing its predecessor) is freed
        first, instead of the restart being told ALREADY_EXISTS while the cohort may
        complete with the dead call."""
        try:
            return self.store.join(intent)
        except AlreadyHeld:
            cohort = self.store.find(intent.job_id)
            held = cohort.state.members.get(intent.member.rank) if cohort else None
            if cohort is None or held is None or self._answers(cohort, held):
                raise
            self._depart(cohort, held)
            return self.store.join(intent)

    def _answers(self, cohort: LiveCohort, member: Member) -> bool:
        """Is `member`'s call still open (as far as grpc knows)?"""
        alive = self._alive.get(ref_of(cohort, member))
        return alive is None or alive()

    def _drop_ended_calls(self, cohort: LiveCohort) -> None:
        """Before a complete cohort is decided: members whose calls have ended (the
        cancel reached grpc, the done callback is still queued) leave first, so a cohort
        never forms with a process that is gone."""
        state = cohort.state
        if cohort.settled or not state.complete:
            return
        for member in [m for m in state.members.values() if not self._answers(cohort, m)]:
            self._depart(cohort, member)

    async def _wait(
        self,
        cohort: LiveCohort,
        held: list[tuple[UploadRef, Member]],
        poke: asyncio.Event,
        intents: list[JoinIntent],
        alive: Callable[[], bool],
    ) -> AsyncIterator[JoinEvent]:
        """Progress, upload asks, then the verdict: woken by `poke` or the progress timer."""
        told: set[tuple[UploadKind, int]] = set()
        asks_seen = -1  # Asks.made when this call last looked at its members' asks
        quiet = all(i.quiet for i in intents)
        last_progress = float("-inf")
        while True:
            if cohort.verdict is not None:
                if await self._recorded(cohort, poke, alive):
                    yield cohort.verdict
                return
            held[:] = [(k, m) for k, m in held if self._pokes.get(k) is poke]
            if not self._still_waiting(held, intents, alive):
                return  # the call is gone: the caller's `finally` frees the ranks
            if cohort.asks.made != asks_seen:
                asks_seen = cohort.asks.made
                for ask in self._new_asks(cohort, held, told):
                    yield ask
            now = self.clock()
            if now - last_progress >= self.progress_interval_s and (not quiet or last_progress < 0):
                last_progress = now
                for _, m in held:
                    m.last_seen = now
                yield self.progress(cohort)
            await self._sleep(poke, None if quiet else last_progress)

    async def _sleep(self, poke: asyncio.Event, last_progress: float | None) -> None:
        """Until `poke`, or the next progress event is due (None: no progress events)."""
        timer = None
        if last_progress is not None:
            # A timer handle, not asyncio.wait_for: that costs a task per wait,
            # which at 16k waiting ranks is most of the coordinator's time.
            wait = self.progress_interval_s - (self.clock() - last_progress)
            timer = asyncio.get_running_loop().call_later(max(wait, 0.0), poke.set)
        await poke.wait()
        if timer is not None:
            timer.cancel()
        poke.clear()

    async def _recorded(
        self, cohort: LiveCohort, poke: asyncio.Event, alive: Callable[[], bool]
    ) -> bool:
        """Wait until the verdict is stored (or no longer waited for); False if the call
        went meanwhile. `_deliver` wakes it."""
        while cohort.recording and not self._closing:
            if not alive():
                return False
            await self._sleep(poke, None)
        return True

    @staticmethod
    def _new_asks(
        cohort: LiveCohort,
        held: list[tuple[UploadRef, Member]],
        told: set[tuple[UploadKind, int]],
    ) -> list[UploadAsk]:
        """The asks this call's members hold that it has not passed on yet."""
        out = []
        for ref, m in held:
            for ask in cohort.asks.of(m):
                if (ask.kind, m.rank) not in told:
                    told.add((ask.kind, m.rank))
                    out.append(UploadAsk(ask.kind, ask.key, ref))
        return out

    def _still_waiting(
        self,
        held: list[tuple[UploadRef, Member]],
        intents: list[JoinIntent],
        alive: Callable[[], bool],
    ) -> bool:
        """False when the call is gone; raises when it must end with an error."""
        if not held:
            ranks = ",".join(str(i.member.rank) for i in intents)
            raise FailedPrecondition(
                f"rank(s) {ranks} joined again on another call; this call is superseded"
            )
        if not alive():
            return False
        if self._closing:
            raise Unavailable(
                "the coordinator is shutting down; the agent will re-join its successor"
            )
        return True

    def _release(
        self, cohort: LiveCohort, held: list[tuple[UploadRef, Member]], poke: object
    ) -> None:
        """A call ended: its members still waiting leave (unless another call took them)."""
        for key, member in held:
            if self._pokes.get(key) is poke:
                del self._pokes[key]
                self._alive.pop(key, None)
                if cohort.verdict is None:
                    self._depart(cohort, member)

    def _depart(self, cohort: LiveCohort, member: Member) -> None:
        if cohort.state.members.get(member.rank) is not member:
            return  # an intruder (another launch), or already replaced
        successors = self.store.leave(cohort, member)
        self.observer.departed()
        self._changed(cohort)
        log.info(
            "rank left before the verdict",
            job=cohort.job_id,
            round=cohort.round,
            rank=member.rank,
            host=member.host,
            incarnation=member.incarnation,
        )
        for successor in successors:
            self._poke(cohort, successor)
        if self.store.abandon(cohort):
            self._abandoned(cohort)

    def _settle(self, cohort: LiveCohort) -> None:
        """A cohort stops waiting (decided or abandoned): its timers and progress go."""
        for label in ("deadline", "uploads", "asks"):
            timer = self._timers.pop((cohort.job_id, cohort.round, label), None)
            if timer is not None:
                timer.cancel()
        self._progress.pop((cohort.job_id, cohort.round), None)

    def _abandoned(self, cohort: LiveCohort) -> None:
        self._settle(cohort)
        self.observer.abandoned()
        self._changed(cohort)
        log.info(
            "round abandoned",
            job=cohort.job_id,
            round=cohort.round,
            reason="every rank left before a verdict; the next join opens a new round",
        )

    def progress(self, cohort: LiveCohort) -> Progress:
        """Cached per cohort for a fraction of the interval: 16k waiting ranks share one."""
        now = self.clock()
        state = cohort.state
        cache_key = (cohort.job_id, cohort.round)
        cached = self._progress.get(cache_key)
        if cached is not None and (
            cached[1] == state.version
            # A large cohort's missing-rank text is O(world size): rebuilt 4 times a second
            # at most, or 16k joins would rebuild it 16k times (O(n^2)).
            or (state.world_size > PROGRESS_EXACT_UP_TO and now - cached[0] < 0.25)
        ):
            return cached[2]
        missing = ranges.missing_text(state.members, state.world_size)
        joined, n = len(state.members), state.world_size
        message = f"{joined}/{n} ranks joined"
        if missing:
            message += f", waiting for ranks {missing}"
        elif state.classes and len(state.classes) > 1:
            message += ", waiting for the manifests that explain the mismatch"
        deadline_in = state.first_join_at + self.options.join_deadline_s - now
        event = Progress(cohort.job_id, cohort.round, joined, n, missing, message, deadline_in)
        self._progress[cache_key] = (now, state.version, event)
        return event

    # -- uploads -----------------------------------------------------------------------
    def wants_upload(self, ref: UploadRef, kind: UploadKind, claimed: bytes, size: int) -> bool:
        """Before an upload is decoded: is `ref` a member expected to send it (raises if
        not), and is it still missing?"""
        return self.store.wants_upload(ref, kind, claimed, size)

    def upload(self, ref: UploadRef, manifest: ManifestLike, claimed: bytes, size: int = 0) -> None:
        try:
            cohort = self.store.upload(ref, manifest, claimed, size)
        except InvalidUpload as exc:
            self.observer.uploaded(False, size)
            self.evaluate(exc.cohort)  # every rank learns why, not only the uploader
            raise
        self.observer.uploaded(True, size)
        log.info(
            "manifest uploaded",
            job=ref.job_id,
            round=ref.round,
            rank=ref.rank,
            signature=claimed.hex()[:12],
            entries=len(manifest),
        )
        self.evaluate(cohort)

    async def upload_digests(self, ref: UploadRef, digests: list[bytes]) -> None:
        """Digests combined under their manifest's names (1M SHA-256 updates for a 1M-entry
        model) in a worker thread when many, then checked and kept on the loop."""
        combined = None
        if len(digests) > INLINE_DIGESTS:
            manifest = self.store.digests_manifest(ref, len(digests))
            combined = await asyncio.to_thread(
                lambda: combine_uploaded((e.name for e in manifest.entries), digests)
            )
        try:
            cohort = self.store.upload_digests(ref, digests, combined)
        except InvalidUpload as exc:
            self.evaluate(exc.cohort)
            raise
        log.info("weight digests uploaded", job=ref.job_id, round=ref.round, rank=ref.rank)
        self.evaluate(cohort)

    # -- decisions ---------------------------------------------------------------------
    def evaluate(self, cohort: LiveCohort) -> None:
        self._drop_ended_calls(cohort)
        if self._heavy(cohort):
            self._decide_off_loop(cohort)
            return
        self._after(cohort, self.store.evaluate(cohort))

    def _heavy(self, cohort: LiveCohort) -> bool:
        """A complete cohort whose decision walks many layout pieces (coverage) or diffs
        large manifests: decided in a worker thread, so the loop keeps serving every other
        job (a 1M-piece coverage check takes a minute)."""
        state = cohort.state
        if cohort.settled or not state.complete:
            return False
        if state.pieces > self.offload_above:
            return True
        return len(state.classes) > 1 and any(
            len(m) > self.offload_above for m in state.manifests.values()
        )

    def _decide_off_loop(self, cohort: LiveCohort) -> None:
        key = (cohort.job_id, cohort.round)
        if key in self._deciding:
            self._deciding[key] = True  # decide again once the running decision returns
            return
        self._deciding[key] = False
        task = asyncio.get_running_loop().create_task(self._off_loop(cohort))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _off_loop(self, cohort: LiveCohort) -> None:
        key = (cohort.job_id, cohort.round)
        try:
            while not cohort.settled and not self._closing:
                self._deciding[key] = False
                seen = cohort.state.fingerprint()
                snapshot, now = cohort.state.snapshot(), self.clock()
                self.observer.metrics.offloaded.inc()
                decision, verdict = await asyncio.get_running_loop().run_in_executor(
                    _workers(), judge, snapshot, now, self.options
                )
                if cohort.state.fingerprint() != seen or self._deciding[key]:
                    continue  # a join, a departure or an upload meanwhile: decide again
                self._after(cohort, self.store.settle(cohort, decision, now, verdict))
                return
        finally:
            self._deciding.pop(key, None)

    def _after(self, cohort: LiveCohort, decision: Decision | None) -> None:
        """What follows a decision: timers and asks while waiting; the verdict's fan-out."""
        if decision is None:
            return
        if cohort.verdict is None:
            # The next moment the decision can change by itself: the join deadline, or the
            # manifest timeout. A timer may fire a hair early (loop clock vs wall clock); it
            # is then simply set again, so a waiting cohort always has its wake-up pending.
            state = cohort.state
            if not state.complete:
                self._schedule(
                    cohort, "deadline", state.first_join_at + self.options.join_deadline_s
                )
            # Logged when the kind of wait changes, not on every join ("[12/16 ranks
            # joined]" and "[13/16 ranks joined]" are the same wait).
            cohort.last_reason = decision.reason
            kind = _DIGITS.sub("#", decision.reason)
            if kind != cohort.last_reason_kind:
                cohort.last_reason_kind = kind
                log.info("waiting", job=cohort.job_id, round=cohort.round, reason=decision.reason)
            for holder in cohort.asks.holders(cohort.state):
                self._poke(cohort, holder)
            if (
                decision.awaiting_manifests or decision.awaiting_digests
            ) and cohort.state.complete_at is not None:
                self._schedule(
                    cohort, "uploads", cohort.state.complete_at + self.options.manifest_timeout_s
                )
            oldest = cohort.asks.oldest()
            if oldest is not None:
                self._schedule(cohort, "asks", oldest + ASK_AGAIN_S, self._ask_again)
            return
        self._decided(cohort)

    def _decided(self, cohort: LiveCohort) -> None:
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
        self._settle(cohort)
        history = self.observer.history
        if history is None or history.problem or self._history_late:
            # A degraded history, or one already late: not waited for (again).
            self.observer.decided(cohort)
            self._deliver(cohort)
        else:
            # Stored first, then sent: a rank whose call breaks as the coordinator dies
            # re-joins its successor and finds this verdict, not a new round it would wait
            # in while the others have formed.
            cohort.recording = True
            loop = asyncio.get_running_loop()
            key = (cohort.job_id, cohort.round, "record")
            self._timers[key] = loop.call_later(RECORD_WAIT_S, self._unrecorded, cohort)

            def written() -> None:  # on the history's writer thread
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                    loop.call_soon_threadsafe(self._stored, cohort)

            self.observer.decided(cohort, written)
        self._changed(cohort)

    def _stored(self, cohort: LiveCohort) -> None:
        self._history_late = False
        self._deliver(cohort)

    def _unrecorded(self, cohort: LiveCohort) -> None:
        if cohort.recording:
            self._history_late = True  # until a verdict is stored again
            log.warning(
                "verdict sent before the history stored it",
                job=cohort.job_id,
                round=cohort.round,
                waited_s=RECORD_WAIT_S,
                advice="the history file is slow or refuses writes; the record is retried",
            )
            self._deliver(cohort)

    def _deliver(self, cohort: LiveCohort) -> None:
        """The verdict goes to every rank waiting on it, another launch's included."""
        cohort.recording = False
        timer = self._timers.pop((cohort.job_id, cohort.round, "record"), None)
        if timer is not None:
            timer.cancel()
        for m in [*cohort.state.members.values(), *cohort.state.intruders]:
            self._poke(cohort, m)

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
            self._poke(cohort, member)
        self.evaluate(cohort)

    def _poke(self, cohort: LiveCohort, member: Member) -> None:
        event = self._pokes.get(ref_of(cohort, member))
        if event is not None:
            event.set()

    def _schedule(
        self,
        cohort: LiveCohort,
        label: str,
        at: float,
        then: Callable[[LiveCohort], None] | None = None,
    ) -> None:
        """Call `then` (evaluate the cohort, by default) at wall time `at`; one pending
        timer per (cohort, label)."""
        key = (cohort.job_id, cohort.round, label)
        if key in self._timers:
            return
        delay = max(at - self.clock(), 0.0) + 0.05
        action = then or self.evaluate

        def fire() -> None:
            self._timers.pop(key, None)
            action(cohort)

        self._timers[key] = asyncio.get_running_loop().call_later(delay, fire)

    # -- status --------------------------------------------------------------------------
    def cohorts(self, job_id: str = "") -> list[LiveCohort]:
        """Every cohort held (waiting and recently decided), optionally of one job."""
        return self.store.cohorts(job_id)

    def summaries(self, job_id: str = "") -> list[CohortSummary]:
        now = self.clock()
        cached = self._listing.get(job_id)
        if cached is not None and cached[1] > LISTING_EXACT_UP_TO and now < cached[0]:
            return cached[2]
        started = time.perf_counter()
        out = [summarize(c, now, self.options) for c in self.cohorts(job_id)]
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
        return [summarize(c, now, self.options) for c in found if c is not None]

    def find(self, job_id: str, round_: int = 0) -> LiveCohort | None:
        return self.store.find(job_id, round_)

    def watch(self, job_id: str = "", holder: str = "") -> AsyncIterator[CohortSummary]:
        """Every matching cohort now, then each one again when it changes: at most once per
        watch interval, the latest state only (see service/watchers.py). `holder` names who
        watches (a token's scope) for the per-token limit."""
        return self.watchers.watch(job_id, holder, lambda: self.summaries(job_id))

    def _changed(self, cohort: LiveCohort) -> None:
        self.watchers.changed((cohort.job_id, cohort.round))

    # -- shutdown ----------------------------------------------------------------------
    def close(self) -> None:
        """Wake every waiting join so it ends with UNAVAILABLE and its agent retries."""
        self._closing = True
        for event in self._pokes.values():
            event.set()
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        self.watchers.close()
