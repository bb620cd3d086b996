"""Read-only views of cohorts for the status API, the status page and the CLI."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from cohortgate.coordinator.decision.formation import FormationOptions, join_deadline
from cohortgate.coordinator.decision.verdict import Cause
from cohortgate.coordinator.service.book import Tracked
from cohortgate.coordinator.state.base import LiveCohort


@dataclass(frozen=True)
class CohortSummary:
    job_id: str
    round: int
    state: str  # waiting | formed | refused | expired | abandoned
    joined: int
    expected: int
    age_s: float
    deadline_in_s: float
    recheck_in_s: float  # when the decision may change by itself (Decision.recheck_at)
    missing_ranks: str
    reason: str
    first_join_at: float
    decided_at: float
    cohort_id: str
    signatures: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def state_of(cohort: LiveCohort) -> str:
    verdict = cohort.verdict
    if cohort.abandoned_at is not None:
        return "abandoned"
    if verdict is None:
        return "waiting"
    if verdict.cause is Cause.DEADLINE and not verdict.present_ranks:
        return "expired"
    return verdict.outcome.value


def summarize(
    cohort: LiveCohort, now: float, options: FormationOptions, tracked: Tracked | None
) -> CohortSummary:
    """`tracked`: what the service tracks of the cohort (None once its verdict is sent)."""
    state = cohort.state
    verdict = cohort.verdict
    if cohort.abandoned_at is not None:
        joined = 0
        missing = ""
        reason = "every rank left before a verdict; the next join opens a new round"
    elif verdict is None:
        joined = len(state.members)
        missing = cohort.missing_text()
        reason = tracked.reason if tracked is not None else ""
    else:
        joined = len(state.members)
        missing = cohort.missing_text()
        reason = verdict.reason
    return CohortSummary(
        job_id=cohort.job_id,
        round=cohort.round,
        state=state_of(cohort),
        joined=joined,
        expected=state.world_size,
        age_s=now - state.first_join_at,
        deadline_in_s=join_deadline(state, options) - now if not cohort.settled else 0.0,
        recheck_in_s=(
            tracked.recheck_at - now
            if tracked is not None and tracked.recheck_at is not None and not cohort.settled
            else 0.0
        ),
        missing_ranks=missing,
        reason=reason,
        first_join_at=state.first_join_at,
        decided_at=verdict.decided_at if verdict else 0.0,
        cohort_id=verdict.cohort_id if verdict else "",
        signatures=len(state.classes),
    )
