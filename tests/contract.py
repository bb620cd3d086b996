"""What the state contract suites share: a clock moved by hand, members and a joined pair."""

from __future__ import annotations

import time
import uuid

from cohortgate.coordinator.decision.cohort import Member
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.base import CohortStore, JoinIntent, LiveCohort
from tests.helpers import manifest_of

M, WIDE = manifest_of(4), manifest_of(8)


class Clock:
    """Wall time, moved by hand (a verdict store may drop verdicts past its retention)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def member(rank: int, manifest: object = M, launch: str = "node0:29500") -> Member:
    signature = manifest.signature()  # type: ignore[attr-defined]
    return Member(
        rank=rank,
        host=f"host{rank}",
        pid=100 + rank,
        incarnation=uuid.uuid4().hex,
        signature=signature,
        manifest_entries=len(manifest),  # type: ignore[arg-type]
        init_method="tcp://127.0.0.1:29999" if rank == 0 else "",
        launch=launch,
    )


def pair(store: CohortStore) -> tuple[LiveCohort, Member, Member]:
    """Ranks 0 and 1 of a 2-rank job "j", joined: its cohort and both members."""
    a, b = member(0), member(1)
    cohort = store.join(JoinIntent("j", 0, a, 2)).cohort
    store.join(JoinIntent("j", 0, b, 2))
    return cohort, a, b


def ref(cohort: LiveCohort, m: Member) -> UploadRef:
    return UploadRef(cohort.job_id, cohort.round, m.rank, m.incarnation)
