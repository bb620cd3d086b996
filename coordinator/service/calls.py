"""The open calls of waiting ranks: the event each sleeps on, and whether it is still open.

A call (a rank's Join, or a relay's JoinGroup of many ranks) is one event and one `alive`;
the calls of each cohort are indexed as calls, so waking a cohort's calls or asking which
have ended costs one step per call, not per rank.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from cohortgate.coordinator.decision.cohort import Member
from cohortgate.coordinator.service.book import Key, key_of, ref_of
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.base import LiveCohort

Alive = Callable[[], bool]


@dataclass(slots=True)
class _Call:
    members: int  # how many of the cohort's members wait on this call
    alive: Alive


class Calls:
    """By each waiting member's (job, round, rank, incarnation): its call's event (set to
    wake the call) and `alive` (is the call still open, as far as grpc knows); by cohort:
    its calls, with how many of its members each holds."""

    def __init__(self) -> None:
        self._held: dict[UploadRef, tuple[asyncio.Event, Alive]] = {}
        self._cohorts: dict[Key, dict[asyncio.Event, _Call]] = {}

    def hold(self, ref: UploadRef, poke: asyncio.Event, alive: Alive) -> bool:
        """`ref` now waits on `poke`; True when it took over another call's wait (which is
        woken, to find itself superseded)."""
        superseded = self._held.get(ref)
        if superseded is not None:
            superseded[0].set()
            self._unindex(ref, superseded[0])
        self._held[ref] = (poke, alive)
        calls = self._cohorts.setdefault((ref.job_id, ref.round), {})
        call = calls.get(poke)
        if call is None:
            calls[poke] = _Call(1, alive)
        else:
            call.members += 1
        return superseded is not None

    def _unindex(self, ref: UploadRef, poke: asyncio.Event) -> None:
        key = (ref.job_id, ref.round)
        calls = self._cohorts.get(key, {})
        call = calls.get(poke)
        if call is None:
            return
        call.members -= 1
        if call.members == 0:
            del calls[poke]
            if not calls:
                del self._cohorts[key]

    def owns(self, ref: UploadRef, poke: object) -> bool:
        held = self._held.get(ref)
        return held is not None and held[0] is poke

    def release(self, ref: UploadRef, poke: asyncio.Event) -> bool:
        """The call of `poke` ended: True if `ref` was still its (then it waits no more)."""
        if not self.owns(ref, poke):
            return False
        del self._held[ref]
        self._unindex(ref, poke)
        return True

    def forget(self, cohort: LiveCohort, member: Member) -> None:
        """`member` left the cohort: its call no longer waits for it (nor is woken for the
        cohort's verdict on its behalf)."""
        ref = ref_of(cohort, member.rank, member.incarnation)
        held = self._held.pop(ref, None)
        if held is not None:
            self._unindex(ref, held[0])

    def poke(self, cohort: LiveCohort, member: Member) -> None:
        held = self._held.get(ref_of(cohort, member.rank, member.incarnation))
        if held is not None:
            held[0].set()

    def poke_all(self, cohort: LiveCohort) -> None:
        """Wake every call waiting on `cohort` (its verdict is out): once per call."""
        for poke in self._cohorts.get(key_of(cohort), {}):
            poke.set()

    def watch(self, cohort: LiveCohort, poke: asyncio.Event, alive: Alive) -> None:
        """A call that holds none of `cohort`'s members (a re-join of its decided round,
        waiting for the verdict to be stored) is woken with its calls."""
        self._cohorts.setdefault(key_of(cohort), {}).setdefault(poke, _Call(0, alive))

    def unwatch(self, cohort: LiveCohort, poke: asyncio.Event) -> None:
        key = key_of(cohort)
        calls = self._cohorts.get(key, {})
        call = calls.get(poke)
        if call is not None and call.members == 0:
            del calls[poke]
            if not calls:
                del self._cohorts[key]

    def holds_all(self, cohort: LiveCohort, poke: asyncio.Event, count: int) -> bool:
        """Does the call of `poke` still hold all `count` members it held of `cohort` (none
        taken by another call since)? One look per call, not one per member: a call holds
        only the members it joined, so its count says it."""
        call = self._cohorts.get(key_of(cohort), {}).get(poke)
        return call is not None and call.members == count

    def answers(self, cohort: LiveCohort, member: Member) -> bool:
        """Is `member`'s call still open (as far as grpc knows)?"""
        held = self._held.get(ref_of(cohort, member.rank, member.incarnation))
        return held is None or held[1]()

    def any_ended(self, cohort: LiveCohort) -> bool:
        """Has any call waiting on `cohort` ended? One `alive` per call."""
        calls = self._cohorts.get(key_of(cohort), {})
        return any(not call.alive() for call in calls.values())

    def wake_all(self) -> None:
        """Every call, watching ones included (every held member's call is indexed)."""
        for calls in self._cohorts.values():
            for poke in calls:
                poke.set()
