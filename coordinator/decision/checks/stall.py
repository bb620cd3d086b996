"""The `stall` check: a formed job that stops making progress (decision/stall.py).

It finds nothing at formation (no step has run yet); it is in the registry for its level,
which `--policy stall=...` and `--job-policy JOB:stall=...` set as for every other check:
strict ends the job with the stall report (every rank writes it to torchrun's error file and
exits), warn reports it and leaves the job alone, off asks nothing of the ranks."""

from __future__ import annotations

from cohortgate.coordinator.decision.checks.base import Check, Context, Result
from cohortgate.coordinator.decision.verdict import Cause, Level


class StallCheck(Check):
    name = "stall"
    default = Level.WARN
    cause = Cause.WEIGHTS  # (never a refusal: stalls happen after formation)
    help = "some rank reaches a new step within --stall-after (cohort.step(n))"
    refusal = "the job stalled during training"
    head = "the job stalled during training"
    advice = "look at the smallest group of ranks first: they are where the others are not."

    def run(self, ctx: Context, level: Level) -> Result:
        return Result()  # stalls are judged during training, never at formation
