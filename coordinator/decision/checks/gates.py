"""Formation's own refusals, before any check runs: ranks of two launches under one job id,
the join deadline, an upload that lies about what its rank joined with. Each owns its
words, as a check does."""

from __future__ import annotations

from coordinator.contract import ranges
from coordinator.contract.diff import ManifestDiff
from coordinator.decision.checks.base import Words
from coordinator.decision.cohort import CohortState
from coordinator.decision.verdict import Cause, Decision, DiffKey
from coordinator.decision.words import hosts, plural, refused


class LaunchGate(Words):
    name = "launch"
    cause = Cause.LAUNCH

    def headline(self, cohort: CohortState, decision: Decision) -> str:
        parts = [
            f"launch {g.launch} (ranks {ranges.compress_capped(g.ranks)} on {hosts(g.hosts)})"
            for g in decision.launches
        ]
        return f"ranks of {len(parts)} launches share job id '{cohort.job_id}': " + ", ".join(parts)

    def report(
        self,
        cohort: CohortState,
        decision: Decision,
        diffs: dict[DiffKey, ManifestDiff | None],
        deadline_s: float,
    ) -> str:
        groups = decision.launches
        head = f"ranks of {len(groups)} different launches joined under this one job id."
        lines = [refused(cohort, head)]
        for g in groups:
            lines.append(
                f"launch {g.launch}: {plural(len(g.ranks), 'rank')} "
                f"[{ranges.compress_capped(g.ranks)}] on {hosts(g.hosts)}"
            )
        lines.append(
            "What to do: two launches (torchrun store endpoints) share the job id "
            f"'{cohort.job_id}'. Give each launch its own --rdzv-id (or COHORTGATE_JOB), or "
            "stop the stale one, then relaunch."
        )
        return "\n".join(lines)


class DeadlineGate(Words):
    name = "deadline"
    cause = Cause.DEADLINE

    def headline(self, cohort: CohortState, decision: Decision) -> str:
        return (
            f"ranks {ranges.compress_capped(decision.missing_ranks)} never joined (join "
            f"deadline passed with {len(decision.present_ranks)}/{cohort.world_size} ranks)"
        )

    def report(
        self,
        cohort: CohortState,
        decision: Decision,
        diffs: dict[DiffKey, ManifestDiff | None],
        deadline_s: float,
    ) -> str:
        present, missing = decision.present_ranks, decision.missing_ranks
        held = tuple(sorted({m.host for m in cohort.members.values()}))
        lines = [
            refused(
                cohort,
                f"the join deadline ({deadline_s:g}s from the first join) passed with "
                f"{len(present)}/{cohort.world_size} ranks joined.",
            ),
            f"missing ranks: {ranges.compress(missing)}",
            f"present ranks: {ranges.compress(present) or 'none'}"
            + (f" on {hosts(held)}" if held else ""),
            "What to do: find out why the missing ranks never reached agent.join() (their "
            "logs, their nodes), or raise the deadline with --join-deadline.",
        ]
        return "\n".join(lines)


class UploadsGate(Words):
    name = "uploads"
    cause = Cause.MANIFEST_INVALID

    def headline(self, cohort: CohortState, decision: Decision) -> str:
        return next(iter(cohort.invalid_uploads.values()), "an upload was invalid")

    def report(
        self,
        cohort: CohortState,
        decision: Decision,
        diffs: dict[DiffKey, ManifestDiff | None],
        deadline_s: float,
    ) -> str:
        reasons = "\n".join(f"  {why}" for why in cohort.invalid_uploads.values())
        kinds = sorted({kind.value for kind, _ in cohort.invalid_uploads})
        return (
            refused(
                cohort,
                f"a rank's uploaded {' and '.join(kinds)} did not match what it joined with.",
            )
            + f"\n{reasons}\n"
            "What to do: run the same cohortgate version on every rank and the coordinator; "
            "a rank that changes its model after signing must sign again."
        )


LAUNCH, DEADLINE, UPLOADS = LaunchGate(), DeadlineGate(), UploadsGate()
GATES: tuple[Words, ...] = (LAUNCH, DEADLINE, UPLOADS)
