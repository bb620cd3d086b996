"""Who a join admits, and into which round: the rules, pure, over plain values.

The store (state/memory.py) holds jobs, rounds and members and asks these functions what to
do with a join; a second store backend keeps data only and asks the same. Each rule raises
the error the rank reads (its status and words) or returns what to do.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from cohortgate.coordinator.contract.errors import (
    AlreadyHeld,
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
)
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.decision.cohort import Member

# A new incarnation of a decided round's member (same launch, same torchrun restart count,
# same model) that joins within this many seconds of the decision is its predecessor's
# successor: the process died as the round was decided and came straight back, and the
# other ranks have their verdict. It gets that verdict, so every rank of the round has one.
# Never a torchrun worker's: torchrun starts a new process of a rank only with its whole
# node, after a crash (raising the restart count) or when another node re-rendezvouses
# (keeping it), and either way the job forms a new round. A
# rank started without torchrun names no launch (a node supervisor, a container restart, a
# harness): its successor is a new process of the same rank on the same host. A harness
# that relaunches a whole job within the window names a launch of its own (as torchrun does).
SUCCESSOR_WINDOW_S = 10.0

# Decided rounds kept per job, so that a rank re-joining with its incarnation gets its
# verdict back; older rounds are forgotten (the history database keeps them for good).
ROUNDS_KEPT = 4


def check_rank(rank: int, world_size: int) -> None:
    """Checked before anything is created: a refused join must leave no trace."""
    if rank >= world_size:
        raise InvalidArgument(
            f"rank {rank} is outside [0, {world_size}) for world size {world_size}"
        )


def check_room(waiting_cohorts: int, waiting_ranks: int, limits: Limits, opening: bool) -> None:
    """The coordinator's bounds on what waits: a flood of bogus joins pins down no more."""
    if opening and waiting_cohorts >= limits.max_cohorts:
        raise LimitExceeded(
            f"{waiting_cohorts} cohorts are waiting, the limit max_cohorts="
            f"{limits.max_cohorts}; this join would open another"
        )
    if waiting_ranks >= limits.max_waiting_ranks:
        raise LimitExceeded(
            f"{waiting_ranks} ranks are waiting, the limit max_waiting_ranks="
            f"{limits.max_waiting_ranks}"
        )


def is_successor(held: Member | None, new: Member, decided_at: float | None, now: float) -> bool:
    """Does `new` take `held`'s place in the round decided at `decided_at` (None: not
    decided)? See SUCCESSOR_WINDOW_S."""
    return not (
        decided_at is None
        or now - decided_at > SUCCESSOR_WINDOW_S
        or held is None
        or new.elastic
        or (held.launch, held.restart_count) != (new.launch, new.restart_count)
        or (not held.launch and held.host != new.host)
        or (held.signature, held.weights_digest, held.layout, held.agreed)
        != (new.signature, new.weights_digest, new.layout, new.agreed)
    )


def check_round(
    job_id: str,
    asked: int,
    open_round: int,
    last_decided: int,
    outcome_of: Callable[[int], str | None],
) -> None:
    """A join that names a round (a re-join after its call dropped) takes part in the open
    round unless a round since the one it names was decided: those ranks have their
    verdict. Every round since was abandoned (a flapping network drops all of a job's calls
    at once, again and again): the rank still belongs in the open round, however many rounds
    went by and were forgotten meanwhile. `outcome_of(round)`: a kept round's outcome (None:
    not decided, or not kept)."""
    if asked in (0, open_round) or last_decided < asked < open_round:
        return
    if asked < open_round:
        since = (outcome_of(r) for r in range(asked, open_round))
        outcome = next((o for o in since if o is not None), "decided")
        raise FailedPrecondition(
            f"round {asked} of job '{job_id}' is over ({outcome}); the open round is "
            f"{open_round}. Join without a round to take part in it."
        )
    raise FailedPrecondition(
        f"round {asked} of job '{job_id}' does not exist yet; the open round is {open_round}"
    )


def check_world(job_id: str, round_: int, world_size: int, asked: int) -> None:
    if asked != world_size:
        raise FailedPrecondition(
            f"world size {asked} disagrees with job '{job_id}' round {round_}, which has "
            f"world size {world_size}; every rank of a job must be launched with the same "
            "WORLD_SIZE"
        )


class Seat(enum.Enum):
    FREE = "free"  # nobody holds the rank
    SAME = "same"  # the same incarnation again
    INTRUDER = "intruder"  # another launch's process for a held rank: refuses the cohort


def seat(job_id: str, round_: int, held: Member | None, new: Member) -> Seat:
    """What a join is to the member holding its rank; AlreadyHeld for a second process of
    the same launch (or of none) claiming it."""
    if held is None:
        return Seat.FREE
    if held.incarnation == new.incarnation:
        return Seat.SAME
    if new.launch and held.launch and new.launch != held.launch:
        return Seat.INTRUDER
    raise AlreadyHeld(
        f"rank {new.rank} of job '{job_id}' round {round_} is already held by incarnation "
        f"{held.incarnation} (host {held.host}, pid {held.pid}); this join is from incarnation "
        f"{new.incarnation} (host {new.host}, pid {new.pid}). Two processes claim the same "
        "RANK: check the launcher."
    )


def rounds_to_forget(rounds: Sequence[tuple[int, bool]]) -> list[int]:
    """Of a job's rounds (number, abandoned), sorted, those to forget: the newest
    ROUNDS_KEPT stay, counting no abandoned one but the open round, so abandoned rounds (a
    flapping network makes many) never push out a verdict that its ranks' re-joins replay."""
    if not rounds:
        return []
    numbers = [r for r, _ in rounds]
    counted = [r for r, abandoned in rounds if not abandoned or r == numbers[-1]]
    keep = set(numbers[-ROUNDS_KEPT:]) | set(counted[-ROUNDS_KEPT:])
    return [r for r in numbers if r not in keep]
