"""The open calls of waiting ranks: the event each sleeps on, and whether it is still open."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from coordinator.decision.cohort import Member
from coordinator.service.book import ref_of
from coordinator.state.asks import UploadRef
from coordinator.state.base import LiveCohort


class Calls:
    """By each waiting member's (job, round, rank, incarnation): its call's event, set to
    wake the call, and its `alive` (is the call still open, as far as grpc knows)."""

    def __init__(self) -> None:
        self._pokes: dict[UploadRef, asyncio.Event] = {}
        self._alive: dict[UploadRef, Callable[[], bool]] = {}

    def hold(self, ref: UploadRef, poke: asyncio.Event, alive: Callable[[], bool]) -> bool:
        """`ref` now waits on `poke`; True when it took over another call's wait (which is
        woken, to find itself superseded)."""
        superseded = self._pokes.get(ref)
        if superseded is not None:
            superseded.set()
        self._pokes[ref] = poke
        self._alive[ref] = alive
        return superseded is not None

    def owns(self, ref: UploadRef, poke: object) -> bool:
        return self._pokes.get(ref) is poke

    def release(self, ref: UploadRef, poke: object) -> bool:
        """The call of `poke` ended: True if `ref` was still its (then it waits no more)."""
        if self._pokes.get(ref) is not poke:
            return False
        del self._pokes[ref]
        self._alive.pop(ref, None)
        return True

    def poke(self, cohort: LiveCohort, member: Member) -> None:
        event = self._pokes.get(ref_of(cohort, member.rank, member.incarnation))
        if event is not None:
            event.set()

    def answers(self, cohort: LiveCohort, member: Member) -> bool:
        """Is `member`'s call still open (as far as grpc knows)?"""
        alive = self._alive.get(ref_of(cohort, member.rank, member.incarnation))
        return alive is None or alive()

    def wake_all(self) -> None:
        for event in self._pokes.values():
            event.set()
