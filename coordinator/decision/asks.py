"""Who is asked for an upload (a manifest, per-tensor digests, code files): one rank of a
class, handed over to another rank of the class when it leaves or stays silent, closed once
the upload lands. Pure functions over a cohort's `AskBook` and its `CohortState`."""

from __future__ import annotations

from cohortgate.coordinator.decision.cohort import (
    Ask,
    AskBook,
    CohortState,
    Member,
    UploadKind,
    modules_key,
)


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


def holder(state: CohortState, ask: Ask) -> Member | None:
    """The member still holding the ask's rank and incarnation, or None if it left."""
    member = state.members.get(ask.rank)
    return member if member is not None and member.incarnation == ask.incarnation else None


def ask(
    book: AskBook,
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
    current = book.open.get((kind, key))
    if current is not None and holder(state, current) is not None:
        return current
    member = prefer if prefer is not None and key_of(prefer, kind) == key else None
    if member is None:
        ranks = _ranks_of(state, kind, key)
        if not ranks:
            book.open.pop((kind, key), None)
            return None
        member = state.members[min(ranks)]
    made = Ask(kind, key, member.rank, member.incarnation, now)
    book.open[(kind, key)] = made
    book.made += 1
    return made


def rotate(book: AskBook, state: CohortState, now: float, after_s: float) -> list[Member]:
    """Asks unanswered for `after_s` go to the next rank of their class (by rank, round the
    class): a silent holder (hung, slow, lost its call) does not hold the cohort until the
    manifest timeout while other ranks could answer. A late answer from the one asked
    before is still taken. Returns the members newly asked."""
    asked = []
    for (kind, key), current in list(book.open.items()):
        if now - current.at < after_s or uploaded(state, kind, key):
            continue
        ranks = sorted(_ranks_of(state, kind, key))
        later = [r for r in ranks if r > current.rank]
        nxt = later[0] if later else ranks[0] if ranks else current.rank
        if nxt == current.rank:
            continue  # the class's only rank: nobody else can answer
        member = state.members[nxt]
        book.open[(kind, key)] = Ask(kind, key, nxt, member.incarnation, now)
        book.made += 1
        asked.append(member)
    return asked


def oldest(book: AskBook) -> float | None:
    """When the longest-open ask was made (None when none is open)."""
    return min((a.at for a in book.open.values()), default=None)


def of(book: AskBook, member: Member) -> list[Ask]:
    """The asks `member` holds (O(1): one lookup per kind)."""
    out = []
    for kind in UploadKind:
        held = book.open.get((kind, key_of(member, kind)))
        if held is not None and (held.rank, held.incarnation) == (member.rank, member.incarnation):
            out.append(held)
    return out


def hand_over(book: AskBook, state: CohortState, member: Member) -> list[Member]:
    """`member` left: each ask it held goes to another member of its class. Returns the
    members newly asked (to wake them)."""
    successors = []
    for held in of(book, member):
        del book.open[(held.kind, held.key)]
        again = ask(book, state, held.kind, held.key, now=held.at)
        if again is not None:
            successors.append(state.members[again.rank])
    return successors


def done(book: AskBook, kind: UploadKind, key: bytes) -> None:
    book.open.pop((kind, key), None)


def holders(book: AskBook, state: CohortState) -> list[Member]:
    """The live members holding an open ask."""
    return [m for a in book.open.values() if (m := holder(state, a)) is not None]
