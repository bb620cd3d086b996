"""The `model` check: every rank that must hold the same model built the same one.

Without a layout that is every rank (one signature class); under a layout, the model's global
fingerprint (config, dtype, quantization) is everyone's and signatures must match within each
replica group (ranks at one shard position).
"""

from __future__ import annotations

from collections.abc import Callable

from cohortgate.coordinator.contract.layout import Layout
from cohortgate.coordinator.decision.checks.base import (
    Check,
    Context,
    Refused,
    Result,
    layout_findings,
)
from cohortgate.coordinator.decision.checks.layout import layered_reason
from cohortgate.coordinator.decision.classes import replica_classes, signature_classes
from cohortgate.coordinator.decision.verdict import Cause, Finding, Level
from cohortgate.coordinator.decision.words import MODEL_ADVICE, all_ranks, plural

# Global fingerprint fields of a layout that name the model itself.
_FINGERPRINT: dict[str, Callable[[Layout], str]] = {
    "model_config": lambda lay: lay.config,
    "dtype": lambda lay: lay.dtype,
    "quantization": lambda lay: lay.quantization,
}


class ModelCheck(Check):
    name = "model"
    default = Level.STRICT
    cause = Cause.SIGNATURE_MISMATCH
    help = "ranks that must hold the same model have the same signature"
    refusal = "model signatures differ"
    head = "their layered identities disagree"  # under a layout; see heading
    advice = MODEL_ADVICE

    def heading(self, r: Refused) -> str:
        classes = r.decision.classes
        if classes and not any(c.group for c in classes):
            n = r.cohort.world_size
            return f"{all_ranks(n)} joined, but with {len(classes)} different model signatures."
        return super().heading(r)

    def run(self, ctx: Context, level: Level) -> Result:
        if ctx.layouts:
            return self._layered(ctx, level)
        classes = signature_classes(ctx.cohort)
        if len(classes) == 1:
            return Result()
        if level is Level.WARN:
            return Result((Finding(self.name, level, f"{len(classes)} different signatures"),))
        return Result(classes=classes, refuse=True)

    def _layered(self, ctx: Context, level: Level) -> Result:
        layouts, n = ctx.layouts, ctx.cohort.world_size
        if len(layouts) < n:
            return Result()  # the layout check names the ranks without one
        found = layout_findings(self.name, level, layouts, _FINGERPRINT)
        if ctx.found_by("layout", Level.STRICT):
            return Result(tuple(found), cause=Cause.LAYOUT)
        classes = replica_classes(ctx.cohort)
        if not classes:
            return Result(tuple(found), cause=Cause.LAYOUT)
        if level is Level.WARN:
            found.append(Finding(self.name, level, "replica groups hold differing signatures"))
            return Result(tuple(found))
        groups = len({c.group for c in classes})
        found.append(
            Finding(
                self.name,
                level,
                f"{plural(groups, 'replica group')} {'holds' if groups == 1 else 'hold'} "
                "differing signatures",
                tuple(r for c in classes for r in c.ranks),
            )
        )
        return Result(tuple(found), classes=classes)

    def reason(self, ctx: Context, strict: list[Finding]) -> str:
        if ctx.layouts:
            return layered_reason(ctx, strict)
        n = ctx.cohort.world_size
        return f"[{n}/{n} ranks joined, {len(ctx.cohort.classes)} different signatures]"
