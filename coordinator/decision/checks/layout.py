"""The `layout` check: every rank declares one mesh, and its position in it exactly once."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.layout import AXES, Layout
from cohortgate.coordinator.decision.checks.base import Check, Context, Result, layout_findings
from cohortgate.coordinator.decision.verdict import Cause, Finding, Level
from cohortgate.coordinator.decision.words import MODEL_ADVICE

# Under a layout the layout, coverage and model checks together are its layered identity.
LAYERED = ("layout", "coverage", "model")


def layered_reason(ctx: Context, strict: list[Finding]) -> str:
    names = ", ".join(sorted({f.check for f in strict if f.check in LAYERED}))
    n = ctx.cohort.world_size
    return f"[{len(ctx.cohort.members)}/{n} ranks joined; layered identity: {names}]"


def position_text(position: Mapping[str, int]) -> str:
    return " ".join(f"{a}={position.get(a, 0)}" for a in AXES)


def _size_of(axis: str) -> Callable[[Layout], str]:
    return lambda lay: str(lay.size(axis))


# Layout fields every rank must agree on for placement (the model's own are the model check's).
_FIELDS: dict[str, Callable[[Layout], str]] = {
    "format": lambda lay: str(lay.format),
    **{f"{a}_size": _size_of(a) for a in AXES},
}


class LayeredCheck(Check):
    """A check of the layered identity (placement, shard coverage): one cause, one set of
    words, one reason naming every layered check that refused."""

    default = Level.STRICT
    cause = Cause.LAYOUT
    refusal = "layered identity"
    head = "their layered identities disagree"
    advice = MODEL_ADVICE

    def reason(self, ctx: Context, strict: list[Finding]) -> str:
        return layered_reason(ctx, strict)


class LayoutCheck(LayeredCheck):
    name = "layout"
    help = "every rank declares the same mesh and holds its position exactly once"

    def run(self, ctx: Context, level: Level) -> Result:
        layouts, members = ctx.layouts, ctx.cohort.members
        if not layouts:
            return Result()
        missing = sorted(set(members) - set(layouts))
        if missing:
            return Result(
                (
                    Finding(
                        self.name,
                        level,
                        f"ranks {ranges.compress_capped(missing)} declared no layout while "
                        f"ranks {ranges.compress_capped(sorted(layouts))} did: every rank "
                        "must declare one",
                        tuple(missing),
                    ),
                )
            )
        out = layout_findings(self.name, level, layouts, _FIELDS)
        if out:
            return Result(tuple(out))
        return Result(tuple(self._placement(layouts, ctx.cohort.world_size, level)))

    def _placement(
        self, layouts: Mapping[int, Layout], world_size: int, level: Level
    ) -> list[Finding]:
        sample = next(iter(layouts.values()))
        sizes = {a: sample.size(a) for a in AXES}
        mesh = math.prod(sizes.values())
        if mesh != world_size:
            shown = " x ".join(f"{a}={s}" for a, s in sizes.items() if s > 1)
            # every axis of size 1: one position, the mesh of a job with no parallelism
            mesh_text = (
                f"the mesh {shown} has {mesh} positions" if shown else "the mesh has 1 position"
            )
            return [
                Finding(
                    self.name,
                    level,
                    f"{mesh_text} but the world size is {world_size}",
                    tuple(sorted(layouts)),
                )
            ]
        out = []
        holders: dict[tuple[int, ...], list[int]] = {}
        for rank, lay in layouts.items():
            bad = [a for a in AXES if not 0 <= lay.position.get(a, 0) < sizes[a]]
            if bad:
                out.append(
                    Finding(
                        self.name,
                        level,
                        f"rank {rank} declares position {position_text(lay.position)}, outside "
                        f"the mesh ({', '.join(f'{a} < {sizes[a]}' for a in bad)})",
                        (rank,),
                    )
                )
            holders.setdefault(lay.position_key, []).append(rank)
        for key, ranks in sorted(holders.items(), key=lambda kv: min(kv[1])):
            if len(ranks) > 1:
                out.append(
                    Finding(
                        self.name,
                        level,
                        f"position {position_text(dict(zip(AXES, key, strict=True)))} is held "
                        f"by ranks {ranges.compress(ranks)}: every position must be held "
                        "exactly once",
                        tuple(sorted(ranks)),
                    )
                )
        return out
