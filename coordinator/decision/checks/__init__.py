"""The check registry: every identity check, in the order the decision runs them.

A check is one module here (a `Check` subclass: name, default level, cause, findings) and one
entry in CHECKS. The order is the precedence: the first check that refuses names the cause;
the findings of every check that ran go into the report. Levels come from `Policies`, for
these and for TRAINING's (audits and stalls, judged during training, not here).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from cohortgate.coordinator.decision.checks.agreement import AGREEMENT_CHECKS
from cohortgate.coordinator.decision.checks.base import Check, Context, Result
from cohortgate.coordinator.decision.checks.coverage import CoverageCheck
from cohortgate.coordinator.decision.checks.layout import LayoutCheck
from cohortgate.coordinator.decision.checks.model import ModelCheck
from cohortgate.coordinator.decision.checks.runtime import RUNTIME_CHECKS
from cohortgate.coordinator.decision.checks.weights import WeightsCheck
from cohortgate.coordinator.decision.verdict import Finding, Level, warnings

# The config precedes the model: a config that differs is why shapes differ (n_layer,
# hidden_size on one rank), so it is the cause, and its fields lead the report; the shape
# differences it caused follow (the model check still runs and shows its classes).
CONFIG, *OTHER_AGREEMENT = AGREEMENT_CHECKS
CHECKS: tuple[Check, ...] = (
    LayoutCheck(),
    CoverageCheck(),
    CONFIG,
    ModelCheck(),
    *OTHER_AGREEMENT,
    *RUNTIME_CHECKS,
    WeightsCheck(),
)


@dataclass(frozen=True)
class TrainingCheck:
    """A policy over what is judged during training, never at formation: its level comes
    from `--policy NAME=LEVEL` and `--job-policy` as every check's; the judging is
    decision/audit.py's or decision/stall.py's, over data, on the service's sweep."""

    name: str
    default: Level
    help: str


TRAINING: tuple[TrainingCheck, ...] = (
    # strict stops the job at a step every rank agrees on; warn reports and goes on; off
    # takes no audits
    TrainingCheck(
        "audit",
        Level.WARN,
        "replicas still hold the same weights at each cohort.audit(model, step)",
    ),
    # strict ends the job with the stall report (every rank writes it to torchrun's error
    # file and exits); warn reports it and leaves the job alone; off asks nothing of ranks
    TrainingCheck(
        "stall", Level.WARN, "some rank reaches a new step within --stall-after (cohort.step(n))"
    ),
)
POLICED: tuple[Check | TrainingCheck, ...] = (*CHECKS, *TRAINING)  # every name --policy takes
DEFAULT_POLICY: dict[str, Level] = {c.name: c.default for c in POLICED}

__all__ = [
    "CHECKS",
    "DEFAULT_POLICY",
    "TRAINING",
    "Check",
    "Context",
    "Finding",
    "Level",
    "Policies",
    "Result",
    "policy_help",
    "warnings",
]


def policy_help() -> str:
    """The checks and their default levels, for --help and the settings' description."""
    checks = ", ".join(f"{c.name} ({c.default})" for c in POLICED)
    return (
        f"CHECK=LEVEL; checks (default level): {checks}; levels: strict (refuse), "
        "warn (form and record), off"
    )


@dataclass(frozen=True)
class Policies:
    """Levels per check; `jobs` overrides them per job id."""

    default: Mapping[str, Level] = field(default_factory=lambda: dict(DEFAULT_POLICY))
    jobs: Mapping[str, Mapping[str, Level]] = field(default_factory=dict)

    def for_job(self, job_id: str) -> dict[str, Level]:
        levels = dict(DEFAULT_POLICY)
        levels.update(self.default)
        levels.update(self.jobs.get(job_id, {}))
        return levels

    @classmethod
    def parse(cls, defaults: Iterable[str] = (), per_job: Iterable[str] = ()) -> Policies:
        """`check=level` items; per job `JOB:check=level`. ValueError says what is wrong."""

        def item(text: str) -> tuple[str, Level]:
            check, sep, level = text.partition("=")
            check, level = check.strip(), level.strip()
            if not sep or check not in DEFAULT_POLICY or level not in set(Level):
                raise ValueError(
                    f"policy {text!r}: expected CHECK=LEVEL with CHECK one of "
                    f"{', '.join(DEFAULT_POLICY)} and LEVEL one of {', '.join(Level)}"
                )
            return check, Level(level)

        base = dict(item(t) for t in defaults)
        jobs: dict[str, dict[str, Level]] = {}
        for text in per_job:
            job, sep, rest = text.rpartition(":")
            if not sep or not job:
                raise ValueError(f"job policy {text!r}: expected JOB:CHECK=LEVEL")
            jobs.setdefault(job, {}).update([item(rest)])
        return cls(base, jobs)
