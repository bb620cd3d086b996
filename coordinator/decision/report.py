"""Verdicts: what every rank of a decided cohort receives, with the refusal report rendered."""

from __future__ import annotations

import uuid
from dataclasses import replace

from coordinator.contract import ranges
from coordinator.contract.diff import ManifestDiff, diff
from coordinator.decision.checks.agreement import AGREEMENT_BY_CAUSE
from coordinator.decision.cohort import CohortState
from coordinator.decision.formation import FormationOptions, decide
from coordinator.decision.verdict import (
    Cause,
    Decision,
    DiffKey,
    Finding,
    LaunchGroup,
    Level,
    Outcome,
    SignatureClass,
    Verdict,
)

# A refused 4,096-node cohort must not print 4,096 host names per class.
HOST_CAP = 8


def _hosts(hosts: tuple[str, ...]) -> str:
    shown = ", ".join(hosts[:HOST_CAP])
    return shown if len(hosts) <= HOST_CAP else f"{shown} and {len(hosts) - HOST_CAP} more"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _class_line(c: SignatureClass, label: str) -> str:
    return (
        f"{label} signature {c.signature.hex()[:12]}: {_plural(len(c.ranks), 'rank')} "
        f"[{ranges.compress_capped(c.ranks)}] on {_plural(len(c.hosts), 'host')} "
        f"{_hosts(c.hosts)}, "
        f"{c.manifest_entries} tensors"
    )


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _class_lines(
    classes: tuple[SignatureClass, ...], diffs: dict[DiffKey, ManifestDiff | None]
) -> list[str]:
    lines = []
    for c in classes:
        if c.reference:
            if c.group:
                lines.append(f"replica group {c.group} (ranks that must be identical):")
            lines.append(_class_line(c, "reference"))
            continue
        lines.append(_class_line(c, "differs:  "))
        d = diffs.get((c.group, c.signature))
        if d is None:
            lines.append("    (no manifest of this class reached the coordinator: no diff)")
        else:
            lines.append(_indent(d.render()))
    return lines


# A weights refusal has four causes; each has its own headline and advice.
WEIGHT_HEADS = {
    "values": "replicas start from different weights.",
    "unsent": "some ranks sent no weight digest, which the weights check (strict) requires.",
    "buffers": "buffers computed from the model config differ (the weights themselves agree): "
    "the ranks' model configs differ, not their seeds.",
    "sharded": "their parameters are sharded DTensors (FSDP2 / tensor parallel) and no layout "
    "was declared, so every rank's shard was compared with every other rank's.",
}
WEIGHT_ADVICE = {
    "values": "every replica must start from the same weights: seed every rank alike, load "
    "the same checkpoint everywhere (look for a stale copy on the hosts named), or broadcast "
    "the weights from one rank before joining.",
    "unsent": "call agent.join(model, verify_values=True) (or agent.init_process_group(..., "
    "verify_values=True)) on every rank, or turn the check off for this job with "
    "--job-policy JOB:weights=off.",
    "buffers": "compare the model config on the ranks named (for example rope_theta, "
    "rope_scaling, max_position_embeddings): buffers such as rotary frequencies are computed "
    "from it. Load one config everywhere.",
    "sharded": "declare the layout (agent.layout(...) passed as layout=) so that only the "
    "ranks holding the same shard are compared, or join without verify_values.",
}


def render_mismatch(
    job_id: str,
    round_: int,
    world_size: int,
    classes: tuple[SignatureClass, ...],
    diffs: dict[DiffKey, ManifestDiff | None],
    findings: tuple[Finding, ...] = (),
    cause: Cause | None = Cause.SIGNATURE_MISMATCH,
    weights: str = "values",
) -> str:
    if cause is Cause.SIGNATURE_MISMATCH and not any(c.group for c in classes):
        head = (
            f"all {world_size} ranks joined, but with "
            f"{sum(1 for c in classes if not c.group)} different model signatures."
        )
    elif cause is Cause.RUNTIME:
        head = f"all {world_size} ranks joined, but their runtimes disagree."
    elif cause is Cause.WEIGHTS:
        head = f"all {world_size} ranks joined with matching models, but " + WEIGHT_HEADS[weights]
    elif cause in AGREEMENT_BY_CAUSE:
        head = f"all {world_size} ranks joined, but they {AGREEMENT_BY_CAUSE[cause].what}."
    else:
        head = f"all {world_size} ranks joined, but their layered identities disagree."
    lines = [f"cohortgate refused to form job '{job_id}' round {round_}: {head}"]
    for f in sorted(findings, key=lambda f: f.level is not Level.STRICT):
        lines.append(f"{f.level} {f.check}: {f.text}")
    lines += _class_lines(classes, diffs)
    if cause is Cause.WEIGHTS:
        lines.append("What to do: " + WEIGHT_ADVICE[weights])
        return "\n".join(lines)
    if cause in AGREEMENT_BY_CAUSE:
        lines.append("What to do: " + AGREEMENT_BY_CAUSE[cause].advice)
        return "\n".join(lines)
    lines.append(
        "What to do: every rank must build the same model (same code, config and dtype) "
        "and, when sharded, declare its true position and pieces. Fix the ranks named above "
        "and relaunch."
    )
    return "\n".join(lines)


def render_deadline(
    job_id: str,
    round_: int,
    world_size: int,
    deadline_s: float,
    missing: tuple[int, ...],
    present: tuple[int, ...],
    hosts: tuple[str, ...],
) -> str:
    lines = [
        f"cohortgate refused to form job '{job_id}' round {round_}: the join deadline "
        f"({deadline_s:g}s from the first join) passed with {len(present)}/{world_size} "
        "ranks joined.",
        f"missing ranks: {ranges.compress(missing)}",
        f"present ranks: {ranges.compress(present) or 'none'}"
        + (f" on {_hosts(hosts)}" if hosts else ""),
        "What to do: find out why the missing ranks never reached agent.join() (their "
        "logs, their nodes), or raise the deadline with --join-deadline.",
    ]
    return "\n".join(lines)


def render_launches(job_id: str, round_: int, groups: tuple[LaunchGroup, ...]) -> str:
    lines = [
        f"cohortgate refused to form job '{job_id}' round {round_}: ranks of {len(groups)} "
        "different launches joined under this one job id."
    ]
    for g in groups:
        lines.append(
            f"launch {g.launch}: {_plural(len(g.ranks), 'rank')} "
            f"[{ranges.compress_capped(g.ranks)}] on {_hosts(g.hosts)}"
        )
    lines.append(
        "What to do: two launches (torchrun store endpoints) share the job id "
        f"'{job_id}'. Give each launch its own --rdzv-id (or COHORTGATE_JOB), or stop the "
        "stale one, then relaunch."
    )
    return "\n".join(lines)


def headline(cohort: CohortState, decision: Decision) -> str:
    """The refusal in one line, culprit ranks first."""
    cause = decision.cause
    if cause is Cause.DEADLINE:
        return (
            f"ranks {ranges.compress_capped(decision.missing_ranks)} never joined (join "
            f"deadline passed with {len(decision.present_ranks)}/{cohort.world_size} ranks)"
        )
    if cause is Cause.LAUNCH:
        parts = [
            f"launch {g.launch} (ranks {ranges.compress_capped(g.ranks)} on {_hosts(g.hosts)})"
            for g in decision.launches
        ]
        return f"ranks of {len(parts)} launches share job id '{cohort.job_id}': " + ", ".join(parts)
    if cause is Cause.MANIFEST_INVALID:
        return next(iter(cohort.invalid_uploads.values()), "an upload was invalid")
    culprits = [c for c in decision.classes if not c.reference]
    if culprits:
        refs = {c.group: c for c in decision.classes if c.reference}
        first = culprits[0]
        ref = refs.get(first.group)
        group = f" in replica group {first.group}" if first.group else ""
        more = f" (and {len(culprits) - 1} more class(es))" if len(culprits) > 1 else ""
        if ref is not None and len(ref.ranks) <= max(len(c.ranks) for c in culprits):
            # A tie for the most ranks: the reference is only the one holding the lowest
            # rank, so no side is named as the one that differs.
            return (
                f"no majority{group}: {_side(ref)} and {_side(first)} built different models"
                f"{more}; compare them to find which one is wrong"
            )
        against = f" ranks {ranges.compress_capped(ref.ranks)}" if ref else " the others"
        return f"{_side(first)} built a different model than{against}{group}{more}"
    return _strict_headline(decision)


def _side(c: SignatureClass) -> str:
    ranks = ranges.compress_capped(c.ranks)
    return f"rank{'s' if len(c.ranks) > 1 else ''} {ranks} on {_hosts(c.hosts)}"


def _strict_headline(decision: Decision) -> str:
    """A refusal by findings: the first strict one, in words."""
    strict = [f for f in decision.findings if f.level is Level.STRICT]
    if not strict:
        return decision.reason.strip("[]")
    if decision.cause in AGREEMENT_BY_CAUSE:
        more = f" (and {len(strict) - 1} more)" if len(strict) > 1 else ""
        return f"{AGREEMENT_BY_CAUSE[decision.cause].refusal}: {strict[0].text}{more}"
    f = strict[0]
    ranks = f"ranks {ranges.compress_capped(f.ranks)}: " if f.ranks else ""
    return f"{f.check}: {ranks}{f.text}"


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
    base = replace(base, headline=headline(cohort, decision))
    if decision.cause is Cause.LAUNCH:
        return replace(
            base,
            present_ranks=decision.present_ranks,
            report=render_launches(cohort.job_id, cohort.round, decision.launches),
        )
    if decision.cause is Cause.DEADLINE:
        hosts = tuple(sorted({m.host for m in cohort.members.values()}))
        report = render_deadline(
            cohort.job_id,
            cohort.round,
            cohort.world_size,
            deadline_s,
            decision.missing_ranks,
            decision.present_ranks,
            hosts,
        )
        return replace(
            base,
            missing_ranks=decision.missing_ranks,
            present_ranks=decision.present_ranks,
            report=report,
        )
    if decision.cause is Cause.MANIFEST_INVALID:
        reasons = "\n".join(f"  {why}" for why in cohort.invalid_uploads.values())
        kinds = sorted({kind.value for kind, _ in cohort.invalid_uploads})
        report = (
            f"cohortgate refused to form job '{cohort.job_id}' round {cohort.round}: a rank's "
            f"uploaded {' and '.join(kinds)} did not match what it joined with.\n{reasons}\n"
            "What to do: run the same cohortgate version on every rank and the coordinator; "
            "a rank that changes its model after signing must sign again."
        )
        return replace(base, report=report)
    diffs: dict[DiffKey, ManifestDiff | None] = {}
    reference = None
    for c in decision.classes:
        if c.reference:
            reference = cohort.manifests.get(c.signature)
            continue
        other = cohort.manifests.get(c.signature)
        # Capped as the wire and the report show it (LIST_CAP items a list, with counts):
        # nine 100k-entry diffs would otherwise hold a million Change objects per verdict.
        diffs[(c.group, c.signature)] = (
            None if reference is None or other is None else diff(reference, other).capped()
        )
    report = render_mismatch(
        cohort.job_id,
        cohort.round,
        cohort.world_size,
        decision.classes,
        diffs,
        decision.findings,
        decision.cause,
        decision.weights or "values",
    )
    return replace(base, diffs=diffs, report=report)


def judge(
    state: CohortState, now: float, options: FormationOptions
) -> tuple[Decision, Verdict | None]:
    """The decision and, when it decides, the verdict with its report: what the store does
    on the loop for a small cohort and a worker process does for a heavy one."""
    decision = decide(state, now, options)
    if decision.outcome is Outcome.WAITING:
        return decision, None
    return decision, build_verdict(state, decision, now, options.join_deadline_s)
