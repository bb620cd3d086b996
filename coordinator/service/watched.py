"""The formed cohorts watched during training, by cohort id: the audits' (service/audits.py)
and the stalls' (service/stalls.py) one way. A cohort is taken on its first call, checked
against the round it claims (a rank of another launch naming a cohort id its round did not
form as is refused), bounded in number (the idle ones make room first), and forgotten when
idle. Its state outlives the live store (--job-retention): it is keyed by the cohort id."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from cohortgate.coordinator.contract.errors import FailedPrecondition, LimitExceeded
from cohortgate.coordinator.service.sweeper import Due

# (job, round) -> the cohort id it formed as and its ranks' hosts, while the store holds it
Formed = Callable[[str, int], tuple[str, dict[int, str]] | None]


class LastSeen(Protocol):
    """What the table keeps: anything that says when a call last brought it news."""

    @property
    def last_seen(self) -> float: ...


T = TypeVar("T", bound=LastSeen)


# How often a sweep forgets the cohorts gone idle.
EVICT_EVERY_S = 10.0


class Watched(Generic[T]):
    """`noun`: what a call brings ("audit", "step mark"); `participle`: what the table does
    to cohorts ("audited", "watched"), for the errors; `sized(n)` after every change,
    `evicted(gone)` after cohorts were forgotten."""

    def __init__(
        self,
        *,
        limit: int,
        room_idle_s: float,
        formed: Formed | None,
        noun: str,
        participle: str,
        sized: Callable[[int], None],
        evicted: Callable[[list[T]], None] = lambda gone: None,
    ) -> None:
        self.cohorts: dict[str, T] = {}
        self.due = Due()  # when each next needs a look (service/sweeper.py)
        self._evicted_at: float | None = None
        self.limit, self.room_idle_s = limit, room_idle_s
        self.formed: Formed = formed or (lambda job_id, round_: None)
        self.noun, self.participle, self.sized, self.evicted = noun, participle, sized, evicted

    def take(
        self,
        cohort_id: str,
        job_id: str,
        round_: int,
        now: float,
        new: Callable[[dict[int, str]], T],
    ) -> T:
        """The cohort's state, made by `new(hosts)` on its first call (`hosts`: its ranks'
        hosts where the store still holds its round, so a rank that never calls is named
        with its host)."""
        c = self.cohorts.get(cohort_id)
        if c is not None:
            return c
        if len(self.cohorts) >= self.limit:
            self.evict(now, self.room_idle_s)
            if len(self.cohorts) >= self.limit:
                raise LimitExceeded(
                    f"{self.limit} cohorts are {self.participle} at once; no more are taken now"
                )
        held = self.formed(job_id, round_)
        if held is not None and held[0] != cohort_id:
            raise FailedPrecondition(
                f"job '{job_id[:64]}' round {round_} formed as cohort {held[0]}; this "
                f"{self.noun} names cohort {cohort_id[:64]} (a rank of another launch?): not "
                "taken"
            )
        c = new(held[1] if held is not None else {})
        self.cohorts[cohort_id] = c
        self.sized(len(self.cohorts))
        return c

    def evict(self, now: float, idle_s: float) -> list[T]:
        """Forget the cohorts nobody called about for `idle_s`; returns them."""
        gone = [k for k, c in self.cohorts.items() if now - c.last_seen > idle_s]
        out = [self.cohorts.pop(k) for k in gone]
        for k in gone:
            self.due.set(k, None)
        self.sized(len(self.cohorts))
        if out:
            self.evicted(out)
        return out

    def sweep(self, now: float, look: Callable[[T], float | None], idle_s: float) -> None:
        """A sweep: the cohorts whose time came (`look_due`), and every EVICT_EVERY_S the
        cohorts nobody called about for `idle_s` forgotten."""
        self.look_due(now, look)
        if self._evicted_at is None:
            self._evicted_at = now
        elif now - self._evicted_at >= EVICT_EVERY_S:
            self._evicted_at = now
            self.evict(now, idle_s)

    def look_due(self, now: float, look: Callable[[T], float | None]) -> None:
        """Look at the cohorts whose time came: `look(c)` acts on one and says when it is
        due next (None: only a call can change it)."""
        for key in self.due.pop(now):
            c = self.cohorts.get(key)
            if c is not None:
                self.due.set(key, look(c))
