"""Admission and waiting: a rank's join enters the store, then its call sleeps until it has
something to say (progress, an upload ask, the verdict); a call that ends frees its rank."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import structlog

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.errors import AlreadyHeld, FailedPrecondition, Unavailable
from cohortgate.coordinator.decision.cohort import Member, UploadKind
from cohortgate.coordinator.decision.formation import FormationOptions, join_deadline
from cohortgate.coordinator.decision.verdict import Verdict
from cohortgate.coordinator.service.book import Book, ref_of
from cohortgate.coordinator.service.calls import Calls
from cohortgate.coordinator.service.deciding import Decider
from cohortgate.coordinator.service.delivery import Delivery
from cohortgate.coordinator.service.departures import Departures
from cohortgate.coordinator.service.events import JoinEvent, Progress, UploadAsk
from cohortgate.coordinator.service.observers import Observer
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.base import (
    CohortStore,
    JoinIntent,
    JoinResult,
    LiveCohort,
    VerdictStore,
)

log = structlog.get_logger("cohortgate")

# Up to this world size every progress event is exact; above, it may be 0.25 s stale.
PROGRESS_EXACT_UP_TO = 1024

Held = list[tuple[UploadRef, Member]]  # a call's members still waiting on it

# A long poll's members stay held this long after an answer that is not the verdict, for
# their next call (a relay calls again within milliseconds). No longer than a stream's
# frozen peer is held: a relay frozen between two polls is dropped as soon as it would be
# on a stream (keepalive, --rank-grace, 15 s by default).
JOIN_POLL_LINGER_S = 5.0


class Admission:
    """Joins and the calls that wait on them: a join enters the store, the decider decides
    the cohort again, delivery says whether its verdict is held back until stored, and a
    call that ends departs its members; `changed` tells the watchers."""

    def __init__(
        self,
        store: CohortStore,
        history: VerdictStore,
        options: FormationOptions,
        observer: Observer,
        clock: Callable[[], float],
        calls: Calls,
        book: Book,
        *,
        progress_interval_s: float,
        decider: Decider,
        delivery: Delivery,
        departures: Departures,
        changed: Callable[[LiveCohort], None],
    ) -> None:
        self.store, self.history, self.options = store, history, options
        self.observer, self.clock = observer, clock
        self.calls, self.book = calls, book
        self.progress_interval_s = progress_interval_s
        self.decider, self.delivery, self.departures = decider, delivery, departures
        self._changed = changed
        # Why joins are refused now (shutting down, standing by); None while admitting.
        self.refusal: Callable[[], Unavailable | None] = lambda: None
        # Members of answered long polls, between two calls: by the event they wait on (one
        # per answered call), and the event by member.
        self._lingering: dict[asyncio.Event, Held] = {}
        self._between: dict[UploadRef, asyncio.Event] = {}

    async def poll(
        self,
        intents: list[JoinIntent],
        alive: Callable[[], bool],
        on_gone: Callable[[Callable[[], None]], None] | None,
    ) -> JoinEvent:
        """JoinPoll: the first event the group has to hear; its members stay held for the
        next call unless it is the verdict."""
        events = self.join_group(intents, alive, on_gone, poll=True)
        try:
            async for event in events:
                return event
        finally:
            await events.aclose()
        raise Unavailable("the call ended before it had an answer")

    async def join_group(
        self,
        intents: list[JoinIntent],
        alive: Callable[[], bool],
        on_gone: Callable[[Callable[[], None]], None] | None,
        *,
        poll: bool = False,
    ) -> AsyncGenerator[JoinEvent]:
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        poke = asyncio.Event()
        admitted = self._replayed_from_history(intents[0]) or self._admit(intents, poke, alive)
        if isinstance(admitted, Verdict):
            yield admitted
            return
        if isinstance(admitted, LiveCohort):  # a decided round it took part in
            # Sent once stored, as to the calls that waited: woken with them by delivery.
            self.calls.watch(admitted, poke, alive)
            try:
                if await self._recorded(admitted, poke, alive):
                    assert admitted.verdict is not None
                    yield admitted.verdict
            finally:
                self.calls.unwatch(admitted, poke)
            return
        cohort, held = admitted
        self._next_poll(cohort, held)
        try:
            if on_gone is not None:
                on_gone(poke.set)
            self.decider.evaluate(cohort)
            self._changed(cohort)
            async for event in self._wait(cohort, held, poke, intents, alive, poll):
                yield event
        finally:
            if poll and alive() and cohort.verdict is None:
                self._linger(cohort, held, poke)  # answered: the next poll takes them
            else:
                self._release(cohort, held, poke)

    def _replayed_from_history(self, first: JoinIntent) -> Verdict | None:
        """After a restart (or once the job left memory): a rank of a decided cohort that
        re-joins with its incarnation gets that verdict back, not a new round."""
        if self.store.holds(first.job_id):
            return None
        stored = self.history.verdict_of(first.job_id, first.member.incarnation)
        if stored is not None:
            log.info("verdict replayed from history", job=first.job_id)
        return stored

    def _admit(
        self, intents: list[JoinIntent], poke: asyncio.Event, alive: Callable[[], bool]
    ) -> LiveCohort | tuple[LiveCohort, Held]:
        """Every intent joins (or all are undone): the cohort and the members now waiting on
        `poke`, or the decided round the same incarnation took part in."""
        held: Held = []
        cohort: LiveCohort | None = None
        waiting = intruders = 0  # counted once for the call, not per rank
        opened = False
        head: JoinResult | None = None  # the call's first rank that joined the open round
        asked: set[bytes] = set()  # signatures whose manifest ask this call ensured
        try:
            for intent in intents:
                result = self._join_store(intent, head, asked)
                head = head or (None if result.replayed else result)
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
                    return result.cohort
                if cohort is not None and result.cohort is not cohort:
                    raise FailedPrecondition("the members of one group joined different rounds")
                cohort, member = result.cohort, result.member
                ref = ref_of(cohort, member.rank, member.incarnation)
                if self.calls.hold(ref, poke, alive):
                    pass  # the same incarnation again: already counted
                elif result.intruder:
                    intruders += 1
                else:
                    waiting += 1
                    opened = opened or result.opened
                held.append((ref, member))
        except BaseException:
            self.observer.joined(waiting, opened, intruders)
            if cohort is not None:
                self._release(cohort, held, poke)
            raise
        assert cohort is not None
        self.observer.joined(waiting, opened, intruders)
        if not (waiting or intruders):
            return cohort, held  # the same members again (a long poll's next call)
        first = held[0][1]
        log.debug(
            "ranks joined",
            job=cohort.job_id,
            round=cohort.round,
            ranks=ranges.compress_capped([m.rank for _, m in held]),
            count=len(held),
            host=first.host,
            signature=first.signature.hex()[:12],
        )
        return cohort, held

    def _join_store(
        self, intent: JoinIntent, first: JoinResult | None, asked: set[bytes]
    ) -> JoinResult:
        """The store's join (after the call's `first` rank, the rest of the call's way); a
        rank held by a call that has ended (its cancel reached grpc, its done callback has
        not run yet: a restart racing its predecessor) is freed first, instead of the
        restart being told ALREADY_EXISTS while the cohort may complete with the dead call."""

        def join() -> JoinResult:
            if first is None:
                return self.store.join(intent, asked)
            return self.store.join_next(first, intent, asked)

        try:
            return join()
        except AlreadyHeld:
            cohort = self.store.find(intent.job_id)
            held = cohort.state.members.get(intent.member.rank) if cohort else None
            if cohort is None or held is None or self.calls.answers(cohort, held):
                raise
            self.departures.depart(cohort, held)
            return join()

    async def _wait(
        self,
        cohort: LiveCohort,
        held: Held,
        poke: asyncio.Event,
        intents: list[JoinIntent],
        alive: Callable[[], bool],
        poll: bool,
    ) -> AsyncIterator[JoinEvent]:
        """Progress, upload asks, then the verdict: woken by `poke` or the progress timer.
        A long poll's asks are told once per cohort and member, across its calls; a quiet
        poll that names its round has had its progress event."""
        told = self.book.of(cohort).polled if poll else set()
        asks_seen = -1  # AskBook.made when this call last looked at its members' asks
        quiet = all(i.quiet for i in intents)
        # The first progress event waits one interval: a call that completes sooner gets
        # only its verdict (most calls of a job that forms at once).
        last_progress = self.clock()
        told_progress = poll and quiet and all(i.round for i in intents)
        while True:
            if cohort.verdict is not None:
                if await self._recorded(cohort, poke, alive):
                    yield cohort.verdict
                return
            if not self.calls.holds_all(cohort, poke, len(held)):
                held[:] = [(k, m) for k, m in held if self.calls.owns(k, poke)]
            if not self._still_waiting(held, intents, alive):
                return  # the call is gone: the caller's `finally` frees the ranks
            if cohort.asks.made != asks_seen:
                asks_seen = cohort.asks.made
                for ask in _new_asks(cohort, held, told):
                    told.add((ask.kind, ask.ref.rank))  # as it goes: a poll takes one
                    yield ask
            now = self.clock()
            if now - last_progress >= self.progress_interval_s and not (quiet and told_progress):
                last_progress, told_progress = now, True
                for _, m in held:
                    m.last_seen = now
                yield self.progress(cohort)
            await self._sleep(poke, None if quiet and told_progress else last_progress)

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
        went meanwhile. Delivery wakes it."""
        while self.delivery.recording(cohort):
            if not alive():
                return False
            refusal = self.refusal()
            if refusal is not None:
                raise refusal  # not stored: never sent (a successor decides again)
            await self._sleep(poke, None)
        return True

    def _still_waiting(
        self, held: Held, intents: list[JoinIntent], alive: Callable[[], bool]
    ) -> bool:
        """False when the call is gone; raises when it must end with an error."""
        if not held:
            ranks = ",".join(str(i.member.rank) for i in intents)
            raise FailedPrecondition(
                f"rank(s) {ranks} joined again on another call; this call is superseded"
            )
        if not alive():
            return False
        refusal = self.refusal()
        if refusal is not None:
            raise refusal
        return True

    def _linger(self, cohort: LiveCohort, held: Held, poke: asyncio.Event) -> None:
        """A long poll answered: its members wait for the next call, on an event nobody
        waits on, for JOIN_POLL_LINGER_S; those no call took by then leave."""
        until = self.clock() + JOIN_POLL_LINGER_S
        between = asyncio.Event()
        still = [(ref, m) for ref, m in held if self.calls.release(ref, poke)]
        for ref, _ in still:
            self.calls.hold(ref, between, lambda: self.clock() < until)
            self._between[ref] = between
        if still:
            self._lingering[between] = still
            asyncio.get_running_loop().call_later(
                JOIN_POLL_LINGER_S, self._end_linger, cohort, between
            )

    def _next_poll(self, cohort: LiveCohort, held: Held) -> None:
        """A call took members of an answered poll: that poll's members it did not take
        have left (a relay polls again with the ranks it still has), now, not when the
        linger ends, so a cohort never forms with them."""
        if not self._between:
            return
        ended = {self._between.pop(ref) for ref, _ in held if ref in self._between}
        for between in ended:
            self._end_linger(cohort, between)

    def _end_linger(self, cohort: LiveCohort, between: asyncio.Event) -> None:
        """The linger is over (its time, or a call took some of its members): members no
        call took leave."""
        rest = self._lingering.pop(between, None)
        if rest is None:
            return  # ended already
        for ref, _ in rest:
            if self._between.get(ref) is between:
                del self._between[ref]
        self._release(cohort, rest, between)  # those another call took stay

    def _release(self, cohort: LiveCohort, held: Held, poke: asyncio.Event) -> None:
        """A call ended: its members still waiting leave (unless another call took them)."""
        for ref, member in held:
            if self.calls.release(ref, poke) and cohort.verdict is None:
                self.departures.depart(cohort, member)

    def progress(self, cohort: LiveCohort) -> Progress:
        """Cached per cohort for a fraction of the interval: 16k waiting ranks share one."""
        now = self.clock()
        state = cohort.state
        tracked = self.book.of(cohort)  # (tracked until its verdict is sent)
        cached = tracked.progress
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
        deadline_in = join_deadline(state, self.options) - now
        event = Progress(cohort.job_id, cohort.round, joined, n, missing, message, deadline_in)
        tracked.progress = (now, state.version, event)
        return event


def _new_asks(cohort: LiveCohort, held: Held, told: set[tuple[UploadKind, int]]) -> list[UploadAsk]:
    """The asks this call's members hold that it has not passed on yet, by member then kind.
    O(open asks), not O(members): a call of 64 ranks holds at most a few asks."""
    asks = list(cohort.asks.open.values())
    if not asks:
        return []
    position = {m.rank: i for i, (_, m) in enumerate(held)}
    kinds = list(UploadKind)
    found: list[tuple[int, int, UploadAsk]] = []
    for ask in asks:
        i = position.get(ask.rank)
        if i is None or (ask.kind, ask.rank) in told:
            continue
        ref, member = held[i]
        if member.incarnation == ask.incarnation:
            found.append((i, kinds.index(ask.kind), UploadAsk(ask.kind, ask.key, ref)))
    return [a for _, _, a in sorted(found, key=lambda f: f[:2])]
