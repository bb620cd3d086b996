"""Verdicts: what every rank of a decided cohort receives. The words are the refusing
check's (or gate's) own; this module assembles them and never switches on the cause."""

from __future__ import annotations

import uuid
from dataclasses import replace

from cohortgate.coordinator.contract.diff import ManifestDiff, diff
from cohortgate.coordinator.decision.checks import CHECKS
from cohortgate.coordinator.decision.checks.base import Refused, Words
from cohortgate.coordinator.decision.checks.gates import GATES
from cohortgate.coordinator.decision.cohort import CohortState
from cohortgate.coordinator.decision.formation import FormationOptions, decide
from cohortgate.coordinator.decision.verdict import Decision, DiffKey, Outcome, Verdict

# What refused, by the name a refusing Decision carries (Decision.check).
WORDS: dict[str, Words] = {w.name: w for w in (*GATES, *CHECKS)}


def _diffs(cohort: CohortState, decision: Decision) -> dict[DiffKey, ManifestDiff | None]:
    """Each class that differs against its group's reference (None: a manifest is missing).
    Capped as the wire and the report show it (LIST_CAP items a list, with counts): nine
    100k-entry diffs would otherwise hold a million Change objects per verdict."""
    diffs: dict[DiffKey, ManifestDiff | None] = {}
    reference = None
    for c in decision.classes:
        if c.reference:
            reference = cohort.manifests.get(c.signature)
            continue
        other = cohort.manifests.get(c.signature)
        diffs[(c.group, c.signature)] = (
            None if reference is None or other is None else diff(reference, other).capped()
        )
    return diffs


def build_verdict(
    cohort: CohortState, decision: Decision, now: float, deadline_s: float
) -> Verdict:
    """Turn a FORMED or REFUSED decision into the verdict every rank will receive."""
    base = Verdict(
        outcome=decision.outcome,
        job_id=cohort.job_id,
        round=cohort.round,
        cohort_id=f"{cohort.job_id}/{cohort.round}/{uuid.uuid4().hex[:8]}",
        world_size=cohort.world_size,
        reason=decision.reason,
        decided_at=now,
        cause=decision.cause,
        classes=decision.classes,
        findings=decision.findings,
    )
    if decision.outcome is Outcome.FORMED:
        rank0 = cohort.members.get(0)
        return replace(base, init_method=rank0.init_method if rank0 else "")
    words = WORDS[decision.check]
    refused = Refused(cohort, decision, _diffs(cohort, decision), deadline_s)
    return replace(
        base,
        diffs=refused.diffs,
        missing_ranks=decision.missing_ranks,
        present_ranks=decision.present_ranks,
        headline=words.headline(refused),
        report=words.report(refused),
    )


def judge(
    state: CohortState, now: float, options: FormationOptions
) -> tuple[Decision, Verdict | None]:
    """The decision and, when it decides, the verdict with its report: what the service
    does on the loop for a small cohort and a worker process does for a heavy one."""
    decision = decide(state, now, options)
    if decision.outcome is Outcome.WAITING:
        return decision, None
    return decision, build_verdict(state, decision, now, options.join_deadline_s)
