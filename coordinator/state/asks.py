"""One ask: one rank of a class is asked for an upload (its manifest, its per-tensor digests),
handed over to another rank of the class when it leaves, closed once the upload lands."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from cohortgate.coordinator.decision.cohort import CohortState, Member, UploadKind, modules_key


class UploadRef(NamedTuple):
    """Who sends an upload: one incarnation of one rank in one round of a job. A tuple: it
    keys every waiting call, and a tuple hashes in C."""

    job_id: str
    round: int
    rank: int
    incarnation: str


@dataclass(frozen=True)
class Ask:
    """Rank `rank` (incarnation `incarnation`) is to upload `kind` for the class `key`."""

    kind: UploadKind
    key: bytes  # the class: a signature (manifest), a weights digest, a modules field
    rank: int
    incarnation: str
    at: float = 0.0  # when this rank was asked


def key_of(member: Member, kind: UploadKind) -> bytes:
    """The class a member belongs to for uploads of `kind`."""
    if kind is UploadKind.MANIFEST:
        return member.signature
    return member.weights_digest if kind is UploadKind.DIGESTS else modules_key(member)


def uploaded(state: CohortState, kind: UploadKind, key: bytes) -> bool:
    if kind is UploadKind.MANIFEST:
        return key in state.manifests
    return key in (state.tensor_digests if kind is UploadKind.DIGESTS else state.files)


def _ranks_of(state: CohortState, kind: UploadKind, key: bytes) -> list[int] | set[int]:
    if kind is UploadKind.MANIFEST:
        return state.classes.get(key, set())
    return [r for r, m in state.members.items() if key_of(m, kind) == key]


class Asks:
    """The open asks of one cohort: at most one per (kind, class), held by a live member."""

    def __init__(self) -> None:
        self._open: dict[tuple[UploadKind, bytes], Ask] = {}
        # Bumped whenever an ask is handed to a member: a waiting call rescans its members'
        # asks only then, not on every wake-up (16k ranks' wake-ups made that a fifth of
        # the loop's time).
        self.made = 0

    def holder(self, state: CohortState, ask: Ask) -> Member | None:
        """The member still holding the ask's rank and incarnation, or None if it left."""
        member = state.members.get(ask.rank)
        return member if member is not None and member.incarnation == ask.incarnation else None

    def ask(
        self,
        state: CohortState,
        kind: UploadKind,
        key: bytes,
        prefer: Member | None = None,
        now: float = 0.0,
    ) -> Ask | None:
        """Make sure some live member of the class is asked (`prefer`, else its lowest rank);
        returns the ask, or None when the upload is in or no member holds the class."""
        if uploaded(state, kind, key):
            return None
        current = self._open.get((kind, key))
        if current is not None and self.holder(state, current) is not None:
            return current
        member = prefer if prefer is not None and key_of(prefer, kind) == key else None
        if member is None:
            ranks = _ranks_of(state, kind, key)
            if not ranks:
                self._open.pop((kind, key), None)
                return None
            member = state.members[min(ranks)]
        made = Ask(kind, key, member.rank, member.incarnation, now)
        self._open[(kind, key)] = made
        self.made += 1
        return made

    def rotate(self, state: CohortState, now: float, after_s: float) -> list[Member]:
        """Asks unanswered for `after_s` go to the next rank of their class (by rank, round
        the class): a silent holder (hung, slow, lost its call) does not hold the cohort
        until the manifest timeout while other ranks could answer. A late answer from the
        one asked before is still taken. Returns the members newly asked."""
        asked = []
        for (kind, key), ask in list(self._open.items()):
            if now - ask.at < after_s or uploaded(state, kind, key):
                continue
            ranks = sorted(_ranks_of(state, kind, key))
            later = [r for r in ranks if r > ask.rank]
            nxt = later[0] if later else ranks[0] if ranks else ask.rank
            if nxt == ask.rank:
                continue  # the class's only rank: nobody else can answer
            member = state.members[nxt]
            self._open[(kind, key)] = Ask(kind, key, nxt, member.incarnation, now)
            self.made += 1
            asked.append(member)
        return asked

    def open_asks(self) -> list[Ask]:
        """Every open ask (a few: at most one per kind and class)."""
        return list(self._open.values())

    def oldest(self) -> float | None:
        """When the longest-open ask was made (None when none is open)."""
        return min((a.at for a in self._open.values()), default=None)

    def of(self, member: Member) -> list[Ask]:
        """The asks `member` holds (O(1): one lookup per kind)."""
        out = []
        for kind in UploadKind:
            ask = self._open.get((kind, key_of(member, kind)))
            if ask is not None and (ask.rank, ask.incarnation) == (
                member.rank,
                member.incarnation,
            ):
                out.append(ask)
        return out

    def hand_over(self, state: CohortState, member: Member) -> list[Member]:
        """`member` left: each ask it held goes to another member of its class. Returns the
        members newly asked (to wake them)."""
        successors = []
        for ask in self.of(member):
            del self._open[(ask.kind, ask.key)]
            again = self.ask(state, ask.kind, ask.key, now=ask.at)
            if again is not None:
                successors.append(state.members[again.rank])
        return successors

    def done(self, kind: UploadKind, key: bytes) -> None:
        self._open.pop((kind, key), None)

    def holders(self, state: CohortState) -> list[Member]:
        """The live members holding an open ask."""
        return [m for a in self._open.values() if (m := self.holder(state, a)) is not None]
