"""The `coverage` check: within each replica the declared pieces tile every logical tensor,
and every replica holds the same tensors."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from cohortgate.coordinator.contract.layout import Layout
from cohortgate.coordinator.contract.ranges import by_value
from cohortgate.coordinator.decision import coverage
from cohortgate.coordinator.decision.checks.base import Context, Result
from cohortgate.coordinator.decision.checks.layout import LayeredCheck
from cohortgate.coordinator.decision.pieces import CohortPieces, Rows
from cohortgate.coordinator.decision.verdict import Finding, Level

# Tensors that fail, examined one by one to name their problems; past this, counted.
DETAILED = 64


class CoverageCheck(LayeredCheck):
    name = "coverage"
    help = "the shards of each replica tile every tensor, once"

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
        table = CohortPieces(layouts)
        return Result(
            tuple(
                self._absent(table, layouts, dp, level)
                + self._shapes(table, level)
                + self._tiling(table, dp, level)
            )
        )

    def _absent(
        self, table: CohortPieces, layouts: Mapping[int, Layout], dp: int, level: Level
    ) -> list[Finding]:
        """Every replica must hold the same logical tensors."""
        held = {replica: table.held_by(replica) for replica in range(dp)}
        everything = np.logical_or.reduce([np.zeros(len(table.names), bool), *held.values()])
        out = []
        for replica, mine in held.items():
            absent = sorted(table.names[t] for t in np.flatnonzero(everything & ~mine).tolist())
            if absent:
                ranks = _culprits(layouts, replica, set(absent))
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

    def _shapes(self, table: CohortPieces, level: Level) -> list[Finding]:
        """Every rank must give a tensor the same logical shape."""
        out = []
        for tensor, shapes in sorted(table.conflicts.items(), key=lambda c: table.names[c[0]]):
            text = f"'{table.names[tensor]}' logical shape: " + by_value(
                {r: str(list(shape)) for r, shape in shapes.items()}
            )
            out.append(Finding(self.name, level, text, tuple(shapes)))
        if table.conflicts_unnamed:
            out.append(
                Finding(
                    self.name,
                    level,
                    f"ranks disagree on the logical shapes of {table.conflicts_unnamed} more "
                    "tensors",
                    (),
                )
            )
        return out

    def _tiling(self, table: CohortPieces, dp: int, level: Level) -> list[Finding]:
        """Within each replica, every logical tensor's pieces must tile it: all at once as
        columns (decision.pieces); the tensors that fail, one by one, to name why."""
        out: list[Finding] = []
        budget = DETAILED
        for replica in range(dp):
            where = f"replica dp={replica}"
            large, failing = table.examine(replica)
            for tensor, rows in large.items():
                shape = tuple(int(v) for v in table.shapes[rows.dims][tensor])
                out += self._tensor(where, table.names[tensor], shape, rows, level)
            named, rest = failing[:budget], failing[budget:]
            budget -= len(named)
            for tensor in named:
                rows = table.pieces_of(replica, tensor)
                shape = tuple(int(v) for v in table.shapes[rows.dims][tensor])
                out += self._tensor(where, table.names[tensor], shape, rows, level)
            if rest:
                shown = ", ".join(f"'{table.names[t]}'" for t in rest[:5])
                out.append(
                    Finding(
                        self.name,
                        level,
                        f"replica dp={replica}: {len(rest)} more tensors do not tile ({shown}"
                        + (", ..." if len(rest) > 5 else "")
                        + "); the report names the problems of the first "
                        f"{DETAILED}",
                        (),
                    )
                )
        return out

    def _tensor(
        self, where: str, tensor: str, shape: tuple[int, ...], rows: Rows, level: Level
    ) -> list[Finding]:
        """What is wrong with one tensor's pieces (as columns) within one replica."""
        rep = np.flatnonzero(rows.replicated)
        if len(rep):
            copies = {
                r: coverage.Piece(r, tuple(o), tuple(n)).describe().split(" on ")[0]
                for r, o, n in zip(
                    rows.rank[rep].tolist(),
                    rows.offsets[rep].tolist(),
                    rows.lengths[rep].tolist(),
                    strict=True,
                )
            }
            if len(set(copies.values())) > 1:
                return [
                    Finding(
                        self.name,
                        level,
                        f"{where}: '{tensor}' replicated pieces disagree: {by_value(copies)}",
                        tuple(copies),
                    )
                ]
            # one copy counts; the others agree with it
            rows = rows.take(~rows.replicated | (np.arange(len(rows.rank)) == rep[0]))
        return [
            Finding(self.name, level, f"{where}: {problem.render()}", problem.ranks)
            for problem in coverage.check_columns(
                tensor, shape, rows.rank, rows.offsets, rows.lengths
            )
        ]


def _culprits(layouts: Mapping[int, Layout], replica: int, names: set[str]) -> tuple[int, ...]:
    """The replica's ranks at the places (every axis but dp) where other replicas hold
    `names`: the ranks that should hold them; the whole replica where none matches."""
    places = {
        lay.replica_key
        for lay in layouts.values()
        if lay.position.get("dp", 0) != replica and not names.isdisjoint(lay.columns().tensors)
    }
    mine = [r for r, lay in layouts.items() if lay.position.get("dp", 0) == replica]
    return tuple(r for r in mine if layouts[r].replica_key in places) or tuple(mine)
