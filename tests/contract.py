"""What the state contract suites share: a clock moved by hand, members and a joined pair."""

from __future__ import annotations

import time

from cohortgate.coordinator.contract.manifest import Manifest
from cohortgate.coordinator.decision.cohort import Member
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.base import CohortStore, JoinIntent, LiveCohort
from tests.helpers import manifest_of, member_of

M, WIDE = manifest_of(4), manifest_of(8)


class Clock:
    """Wall time, moved by hand (a verdict store may drop verdicts past its retention)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def member(rank: int, manifest: Manifest = M, launch: str = "node0:29500") -> Member:
    """A rank's join as a store holds it, one host per rank, of launch `launch`."""
    return member_of(rank, manifest, host=f"host{rank}", pid=100 + rank, launch=launch)


def pair(store: CohortStore) -> tuple[LiveCohort, Member, Member]:
    """Ranks 0 and 1 of a 2-rank job "j", joined: its cohort and both members."""
    a, b = member(0), member(1)
    cohort = store.join(JoinIntent("j", 0, a, 2)).cohort
    store.join(JoinIntent("j", 0, b, 2))
    return cohort, a, b


def ref(cohort: LiveCohort, m: Member) -> UploadRef:
    return UploadRef(cohort.job_id, cohort.round, m.rank, m.incarnation)
