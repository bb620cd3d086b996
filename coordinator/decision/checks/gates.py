"""Formation's own refusals, before any check runs: ranks of two launches under one job id,
the join deadline, an upload that lies about what its rank joined with. Each owns its
words, as a check does."""

from __future__ import annotations

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.decision.checks.base import Refused, Words
from cohortgate.coordinator.decision.verdict import Cause
from cohortgate.coordinator.decision.words import hosts, plural, refused


class LaunchGate(Words):
    name = "launch"
    cause = Cause.LAUNCH

    def headline(self, r: Refused) -> str:
        parts = [
            f"launch {g.launch} (ranks {ranges.compress_capped(g.ranks)} on {hosts(g.hosts)})"
            for g in r.decision.launches
        ]
        return f"ranks of {len(parts)} launches share job id '{r.cohort.job_id}': " + ", ".join(
            parts
        )

    def report(self, r: Refused) -> str:
        groups = r.decision.launches
        head = f"ranks of {len(groups)} different launches joined under this one job id."
        lines = [refused(r.cohort, head)]
        for g in groups:
            lines.append(
                f"launch {g.launch}: {plural(len(g.ranks), 'rank')} "
                f"[{ranges.compress_capped(g.ranks)}] on {hosts(g.hosts)}"
            )
        lines.append(
            "What to do: two launches (torchrun store endpoints) share the job id "
            f"'{r.cohort.job_id}'. Give each launch its own --rdzv-id (or COHORTGATE_JOB), or "
            "stop the stale one, then relaunch."
        )
        return "\n".join(lines)


class DeadlineGate(Words):
    name = "deadline"
    cause = Cause.DEADLINE

    def headline(self, r: Refused) -> str:
        return (
            f"ranks {ranges.compress_capped(r.decision.missing_ranks)} never joined (join "
            f"deadline passed with {len(r.decision.present_ranks)}/{r.cohort.world_size} ranks)"
        )

    def report(self, r: Refused) -> str:
        present, missing = r.decision.present_ranks, r.decision.missing_ranks
        held = tuple(sorted({m.host for m in r.cohort.members.values()}))
        lines = [
            refused(
                r.cohort,
                f"the join deadline ({r.deadline_s:g}s from the first join) passed with "
                f"{len(present)}/{r.cohort.world_size} ranks joined.",
            ),
            f"missing ranks: {ranges.compress(missing)}",
            f"present ranks: {ranges.compress(present) or 'none'}"
            + (f" on {hosts(held)}" if held else ""),
            "What to do: find out why the missing ranks never reached cohortgate.join() (their "
            "logs, their nodes), or raise the deadline with --join-deadline.",
        ]
        return "\n".join(lines)


class UploadsGate(Words):
    name = "uploads"
    cause = Cause.MANIFEST_INVALID

    def headline(self, r: Refused) -> str:
        return next(iter(r.cohort.invalid_uploads.values()), "an upload was invalid")

    def report(self, r: Refused) -> str:
        reasons = "\n".join(f"  {why}" for why in r.cohort.invalid_uploads.values())
        kinds = sorted({kind.value for kind, _ in r.cohort.invalid_uploads})
        return (
            refused(
                r.cohort,
                f"a rank's uploaded {' and '.join(kinds)} did not match what it joined with.",
            )
            + f"\n{reasons}\n"
            "What to do: run the same cohortgate version on every rank and the coordinator; "
            "a rank that changes its model after signing must sign again."
        )


LAUNCH, DEADLINE, UPLOADS = LaunchGate(), DeadlineGate(), UploadsGate()
GATES: tuple[Words, ...] = (LAUNCH, DEADLINE, UPLOADS)
