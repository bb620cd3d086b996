"""The `coverage` check: within each replica the declared pieces tile every logical tensor,
and every replica holds the same tensors."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.contract.layout import Layout
from coordinator.contract.ranges import by_value
from coordinator.decision import coverage
from coordinator.decision.checks.base import (
    Check,
    Context,
    Finding,
    Level,
    Result,
    disagreement,
)
from coordinator.decision.checks.layout import layered_reason
from coordinator.decision.cohort import Cause

PieceHeld = tuple[int, coverage.Piece, tuple[int, ...], bool]  # rank, piece, shape, replicated


class CoverageCheck(Check):
    name = "coverage"
    default = Level.STRICT
    cause = Cause.LAYOUT
    help = "the shards of each replica tile every tensor, once"
    refusal = "layered identity"

    def run(self, ctx: Context, level: Level) -> Result:
        layouts = ctx.layouts
        # Placement first: with positions wrong (or unchecked), the replicas are too.
        if (
            len(layouts) < ctx.cohort.world_size
            or ctx.levels["layout"] is Level.OFF
            or ctx.found_by("layout")
        ):
            return Result()
        dp = next(iter(layouts.values())).size("dp")
        return Result(tuple(self._absent(layouts, dp, level) + self._tiling(layouts, dp, level)))

    def _absent(self, layouts: Mapping[int, Layout], dp: int, level: Level) -> list[Finding]:
        """Every replica must hold the same logical tensors."""
        names = {
            replica: {
                p.tensor
                for lay in layouts.values()
                if lay.position.get("dp", 0) == replica
                for p in lay.pieces
            }
            for replica in range(dp)
        }
        everything = set().union(*names.values()) if names else set()
        out = []
        for replica, tensor_names in names.items():
            absent = sorted(everything - tensor_names)
            if absent:
                ranks = tuple(
                    r for r, lay in layouts.items() if lay.position.get("dp", 0) == replica
                )
                shown = ", ".join(f"'{t}'" for t in absent[:10])
                more = f" and {len(absent) - 10} more" if len(absent) > 10 else ""
                out.append(
                    Finding(
                        self.name,
                        level,
                        f"replica dp={replica} declares no piece of {shown}{more}, which other "
                        "replicas hold",
                        ranks,
                    )
                )
        return out

    def _tiling(self, layouts: Mapping[int, Layout], dp: int, level: Level) -> list[Finding]:
        """Within each replica, every logical tensor's pieces must tile it."""
        out: list[Finding] = []
        for replica in range(dp):
            tensors: dict[str, list[PieceHeld]] = {}
            for rank, lay in layouts.items():
                if lay.position.get("dp", 0) != replica:
                    continue
                for p in lay.pieces:
                    tensors.setdefault(p.tensor, []).append(
                        (rank, coverage.Piece(rank, p.offset, p.length), p.shape, p.replicated)
                    )
            for tensor, held in sorted(tensors.items()):
                out += self._tensor(f"replica dp={replica}", tensor, held, level)
        return out

    def _tensor(
        self, where: str, tensor: str, held: list[PieceHeld], level: Level
    ) -> list[Finding]:
        shapes = {r: str(list(shape)) for r, _, shape, _ in held}
        text = disagreement(f"'{tensor}' logical shape", shapes)
        if text is not None:
            return [Finding(self.name, level, f"{where}: {text}", tuple(shapes))]
        copies = {(p.offset, p.length) for _, p, _, rep in held if rep}
        if len(copies) > 1:
            boxes = {r: p.describe().split(" on ")[0] for r, p, _, rep in held if rep}
            return [
                Finding(
                    self.name,
                    level,
                    f"{where}: '{tensor}' replicated pieces disagree: {by_value(boxes)}",
                    tuple(boxes),
                )
            ]
        pieces = [p for _, p, _, rep in held if not rep]
        replicated = [p for _, p, _, rep in held if rep]
        if replicated:
            pieces.append(replicated[0])  # one copy counts; the others agree with it
        return [
            Finding(self.name, level, f"{where}: {problem.render()}", problem.ranks)
            for problem in coverage.check(tensor, held[0][2], pieces)
        ]

    def reason(self, ctx: Context, strict: list[Finding]) -> str:
        return layered_reason(ctx, strict)
