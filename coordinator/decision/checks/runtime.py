"""The `runtime.*` checks: every rank runs the same software and device stack, field by field."""

from __future__ import annotations

from collections.abc import Callable

from cohortgate.coordinator.decision.checks.base import (
    Check,
    Context,
    Result,
    disagreement,
    minority,
)
from cohortgate.coordinator.decision.verdict import Cause, Finding, Level


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2]) if version else ""


class RuntimeCheck(Check):
    """One runtime field every rank must agree on (normalised first: NCCL by major.minor)."""

    cause = Cause.RUNTIME
    refusal = "runtimes disagree"
    head = "their runtimes disagree"
    advice = (
        "every rank must run the same software and device stack: the fields above differ "
        "between the ranks named (another container image, driver or torch build on some "
        "nodes). Run one image everywhere, or set --policy CHECK=warn for a difference you "
        "accept, then relaunch."
    )

    def __init__(
        self, name: str, field: str, default: Level, normal: Callable[[str], str] = str
    ) -> None:
        self.name = name  # type: ignore[misc]  # one class, six checks
        self.field = field
        self.default = default  # type: ignore[misc]
        self.normal = normal
        self.help = f"every rank reports the same {field}"  # type: ignore[misc]

    def run(self, ctx: Context, level: Level) -> Result:
        seen = {self.normal(rt.get(self.field, "")) for rt in ctx.runtimes()}
        if len(seen) <= 1:
            return Result()  # every rank agrees: no per-rank look
        members = ctx.cohort.members
        values = {r: self.normal(m.runtime.get(self.field, "")) for r, m in members.items()}
        text = disagreement(self.field, values)
        if text is None:
            return Result()
        return Result((Finding(self.name, level, text, minority(values)),))

    def reason(self, ctx: Context, strict: list[Finding]) -> str:
        n = ctx.cohort.world_size
        names = ", ".join(f.check for f in strict if f.check.startswith("runtime."))
        return f"[{n}/{n} ranks joined; runtimes disagree: {names}]"


RUNTIME_CHECKS = (
    RuntimeCheck("runtime.device_type", "device_type", Level.STRICT),
    RuntimeCheck("runtime.nccl", "nccl_version", Level.STRICT, _major_minor),
    RuntimeCheck("runtime.torch", "torch_version", Level.WARN),
    RuntimeCheck("runtime.cuda", "cuda_version", Level.WARN),
    RuntimeCheck("runtime.device_name", "device_name", Level.WARN),
    RuntimeCheck("runtime.device_capability", "device_capability", Level.WARN),
)
