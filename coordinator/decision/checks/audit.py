"""The `audit` check: replicas that stay the same during training (decision/audit.py).

It finds nothing at formation (no step has run yet); it is in the registry for its level,
which `--policy audit=...` and `--job-policy JOB:audit=...` set as for every other check:
strict stops the job at a step every rank agrees on, warn reports and goes on, off takes no
audits."""

from __future__ import annotations

from cohortgate.coordinator.decision.checks.base import Check, Context, Result
from cohortgate.coordinator.decision.verdict import Cause, Level


class AuditCheck(Check):
    name = "audit"
    default = Level.WARN
    cause = Cause.WEIGHTS
    help = "replicas still hold the same weights at each cohort.audit(model, step)"
    refusal = "replicas diverged during training"
    head = "replicas diverged during training"
    advice = "take the named host out of service and resume from an earlier checkpoint."

    def run(self, ctx: Context, level: Level) -> Result:
        return Result()  # audits are judged during training, never at formation
