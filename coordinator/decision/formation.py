"""The formation decision: one pure function of (cohort, now, options) -> decision + reason.

It reads top to bottom: launches, completeness, uploaded manifests, then every check of the
registry in order, with one ending for sharded and unsharded cohorts alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.decision.checks import CHECKS, Check, Context, Policies, Result
from cohortgate.coordinator.decision.checks.gates import DEADLINE, LAUNCH, UPLOADS
from cohortgate.coordinator.decision.classes import launch_groups, signature_classes
from cohortgate.coordinator.decision.cohort import INVALID_UPLOAD, CohortState
from cohortgate.coordinator.decision.verdict import (
    Decision,
    Level,
    Outcome,
    SignatureClass,
)


@dataclass(frozen=True)
class FormationOptions:
    # 600 s: long enough for a slow node to pull its image and load data before joining,
    # short enough that a job with a dead node fails within a coffee break, not an hour.
    join_deadline_s: float = 600.0
    # Once every rank has joined, how long to wait for the manifests that explain a
    # mismatch before refusing without them (their uploaders were asked at join time).
    manifest_timeout_s: float = 30.0
    policies: Policies = field(default_factory=Policies)
    # Audits during training: a rank that has not sent its audit of a step this long after
    # the first rank did is named, and the step compared without it.
    audit_timeout_s: float = 60.0
    # Stalls during training (decision/stall.py): seconds without a new step on any rank,
    # None for auto (20 times the median step time, at least 60 s); per job overrides; the
    # longest on-purpose pause (cohort.pause) the detection skips.
    stall_after_s: float | None = None
    job_stall_after: tuple[tuple[str, float | None], ...] = ()
    pause_limit_s: float = 1800.0
    # A rank whose steps take this many times its cohort's median is a straggler (0: off).
    straggler_ratio: float = 1.5

    def stall_after_for(self, job_id: str) -> float | None:
        for job, seconds in self.job_stall_after:
            if job == job_id:
                return seconds
        return self.stall_after_s


def decide(cohort: CohortState, now: float, options: FormationOptions) -> Decision:
    """Formed, refused or still waiting, with a one-line reason in brackets."""
    n, joined = cohort.world_size, len(cohort.members)
    if len(cohort.launches) > 1 or cohort.intruders:
        # At once, not at completion: the ranks of the other launch would otherwise wait
        # on ALREADY_EXISTS, or two half-jobs would form one cohort and train together.
        groups = launch_groups(cohort)
        return Decision(
            Outcome.REFUSED,
            f"[ranks of {len(groups)} launches joined under one job id]",
            cause=LAUNCH.cause,
            check=LAUNCH.name,
            launches=groups,
            present_ranks=tuple(sorted(cohort.members)),
        )
    if joined < n:
        deadline = join_deadline(cohort, options)
        if now < deadline:
            return Decision(Outcome.WAITING, f"[{joined}/{n} ranks joined]", recheck_at=deadline)
        missing = ranges.missing(cohort.members, n)
        return Decision(
            Outcome.REFUSED,
            f"[join deadline of {options.join_deadline_s:g}s passed with {joined}/{n} ranks "
            f"joined; missing ranks {ranges.compress(missing)}]",
            cause=DEADLINE.cause,
            check=DEADLINE.name,
            missing_ranks=tuple(missing),
            present_ranks=tuple(sorted(cohort.members)),
        )
    # Refused only once every rank is here, so that every rank hears why.
    if cohort.invalid_uploads:
        kinds = Counter(kind for kind, _ in cohort.invalid_uploads)
        said = "; ".join(f"{count} {INVALID_UPLOAD[kind]}" for kind, count in kinds.items())
        return Decision(Outcome.REFUSED, f"[{said}]", cause=UPLOADS.cause, check=UPLOADS.name)
    # Each class's manifest is checked against its signature before the verdict: for one
    # class that proves the signature is honest, for several it explains the difference.
    classes = signature_classes(cohort)
    awaiting = tuple(c.signature for c in classes if c.signature not in cohort.manifests)
    due = uploads_due(cohort, now, options)
    if awaiting and now < due:
        signatures = "1 signature" if len(classes) == 1 else f"{len(classes)} different signatures"
        return Decision(
            Outcome.WAITING,
            f"[{n}/{n} ranks joined, {signatures}, waiting for {len(awaiting)} manifest(s)]",
            classes=classes,
            awaiting_manifests=awaiting,
            recheck_at=due,
        )
    return _checked(cohort, now, options, due, unverified=bool(awaiting))


def join_deadline(cohort: CohortState, options: FormationOptions) -> float:
    """When a round that is still missing ranks is refused: its first join + the deadline."""
    return cohort.first_join_at + options.join_deadline_s


def uploads_due(cohort: CohortState, now: float, options: FormationOptions) -> float:
    """Until when the uploads that explain a cohort are waited for: the upload timeout
    after every rank joined (their uploaders were asked at join time)."""
    complete_at = cohort.complete_at if cohort.complete_at is not None else now
    return complete_at + options.manifest_timeout_s


def _checked(
    cohort: CohortState, now: float, options: FormationOptions, due: float, *, unverified: bool
) -> Decision:
    """Every check of the registry in order; the first that refuses names the cause."""
    layouts = {r: m.layout for r, m in cohort.members.items() if m.layout is not None}
    ctx = Context(cohort, now, due, options.policies.for_job(cohort.job_id), layouts)
    refusing: tuple[Check, Result] | None = None
    classes: tuple[SignatureClass, ...] = ()
    for check in CHECKS:
        level = ctx.levels[check.name]
        if level is Level.OFF or (check.needs_clean and refusing is not None):
            continue
        result = check.run(ctx, level)
        if result.waiting:
            return Decision(
                Outcome.WAITING,
                result.waiting,
                awaiting_digests=result.awaiting_digests,
                awaiting_files=result.awaiting_files,
                recheck_at=due,
            )
        ctx.found += result.findings
        classes = classes or result.classes
        if refusing is None and result.refuses:
            refusing = (check, result)
    findings = tuple(ctx.found)
    if refusing is not None:
        check, result = refusing
        strict = [f for f in findings if f.level is Level.STRICT]
        return Decision(
            Outcome.REFUSED,
            result.reason or check.reason(ctx, strict),
            cause=result.cause or check.cause,
            check=check.name,
            classes=classes,
            findings=findings,
            weights=result.weights,
        )
    n, suffix = cohort.world_size, ", manifest not verified" if unverified else ""
    if layouts:
        groups = len({lay.replica_key for lay in layouts.values()})
        reason = (
            f"[{n}/{n} ranks joined, {len(cohort.classes)} signature(s) across {groups} "
            f"replica groups{suffix}]"
        )
    else:
        reason = f"[{n}/{n} ranks joined, 1 signature{suffix}]"
    return Decision(Outcome.FORMED, reason, findings=findings)
