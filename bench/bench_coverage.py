"""Coverage check cost: 1,000,000 pieces (a grid layout, flat FSDP-style ranges, and a brick
wall that no grid tiles: valid, with one brick shifted by a column (an overlap and a gap),
and with one brick missing). Medians of --repeats runs, each layout's runs back to back.

Two parts. The geometry alone (`check_arrays` on columns, `check` on Piece objects). Then
the path the coordinator runs: each rank's layout as its wire bytes (PieceColumns, <= 100k
pieces a rank, as agents send them), decoded and validated (`layout_from_pb`, per join, in
the coordinator's decode thread), then the coverage check's own entry point
(`CoverageCheck.run` over the cohort's layouts, as the decision calls it), on a 3-D grid,
the brick walls, and 62,500 tensors split 16 ways (a TP=16 job of a large model); the 3-D
grid also dealt round-robin to 16 ranks (no rank holds a contiguous region), valid and with
one block moved by one element along an axis.

Usage: python bench/bench_coverage.py [--pieces 1000000] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.contract.layout import Layout, PieceColumns
from cohortgate.coordinator.decision.checks.base import Context
from cohortgate.coordinator.decision.checks.coverage import CoverageCheck
from cohortgate.coordinator.decision.coverage import Piece, check, check_arrays
from cohortgate.coordinator.decision.verdict import Level

RANK_PIECES = 62_500  # under the per-rank limit (100,000)


def bricks(rows: int, columns: int) -> tuple[np.ndarray, np.ndarray]:
    """Even rows in bricks of 2 from column 0, odd rows from column 1 with half-bricks at
    both ends: (offsets, lengths), ~columns/2 pieces a row."""
    even = np.arange(0, columns, 2, dtype=np.int64)
    odd = np.concatenate(([0], np.arange(1, columns - 1, 2), [columns - 1])).astype(np.int64)
    odd_width = np.concatenate(([1], np.full(len(odd) - 2, 2), [1])).astype(np.int64)
    offsets, lengths = [], []
    for r in range(rows):
        starts = even if r % 2 == 0 else odd
        widths = np.full(len(even), 2, dtype=np.int64) if r % 2 == 0 else odd_width
        offsets.append(np.stack([np.full(len(starts), r, dtype=np.int64), starts], axis=1))
        lengths.append(np.stack([np.ones(len(starts), dtype=np.int64), widths], axis=1))
    return np.concatenate(offsets), np.concatenate(lengths)


def columns(
    names: list[str],
    shapes: np.ndarray,
    tensor: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
) -> PieceColumns:
    """A rank's pieces (sorted by `tensor`, an index into `names`) as an agent sends them."""
    dims = shapes.shape[1]
    counts = np.bincount(tensor, minlength=len(names)).astype("<u4")
    width = 4 if max(int(shapes.max()), int((offsets + lengths).max())) < 2**31 else 8
    kind = f"<i{width}"
    return PieceColumns(
        tuple(names),
        bytes([dims]) * len(names),
        shapes.astype(kind).tobytes(),
        counts.tobytes(),
        offsets.astype(kind).tobytes(),
        lengths.astype(kind).tobytes(),
        bytes(len(tensor)),
        width,
    )


def one_tensor(shape: tuple[int, ...], offsets: np.ndarray, lengths: np.ndarray) -> list[bytes]:
    """One tensor's pieces dealt to ranks RANK_PIECES at a time: each rank's wire bytes."""
    out = []
    for r, start in enumerate(range(0, len(offsets), RANK_PIECES)):
        o, ln = offsets[start : start + RANK_PIECES], lengths[start : start + RANK_PIECES]
        cols = columns(["w"], np.array([shape]), np.zeros(len(o), dtype=np.int64), o, ln)
        out.append(wire.layout_to_pb(Layout({"tp": 1}, {"tp": r}, pieces=cols)).SerializeToString())
    return out


def dealt(
    shape: tuple[int, ...], offsets: np.ndarray, lengths: np.ndarray, ranks: int = 16
) -> list[bytes]:
    """One tensor's pieces dealt round-robin to `ranks` ranks (piece i to rank i % ranks),
    so that no rank holds a contiguous region: each rank's wire bytes."""
    out = []
    for r in range(ranks):
        o, ln = offsets[r::ranks], lengths[r::ranks]
        cols = columns(["w"], np.array([shape]), np.zeros(len(o), dtype=np.int64), o, ln)
        out.append(
            wire.layout_to_pb(Layout({"tp": ranks}, {"tp": r}, pieces=cols)).SerializeToString()
        )
    return out


def tp_split(tensors: int, tp: int) -> list[bytes]:
    """`tensors` 4096 x 4096 weights, even ones split by rows, odd ones by columns, over tp
    ranks: each rank holds one piece of every tensor."""
    names = [f"model.layers.{i // 8}.w{i % 8}.weight" for i in range(tensors)]
    shapes = np.full((tensors, 2), 4096, dtype=np.int64)
    tensor = np.arange(tensors, dtype=np.int64)
    by_rows = (tensor % 2 == 0)[:, None]
    out = []
    step = 4096 // tp
    for r in range(tp):
        lengths = np.where(by_rows, [[step, 4096]], [[4096, step]])
        offsets = np.where(by_rows, [[r * step, 0]], [[0, r * step]])
        cols = columns(names, shapes, tensor, offsets, lengths)
        out.append(
            wire.layout_to_pb(Layout({"tp": tp}, {"tp": r}, pieces=cols)).SerializeToString()
        )
    return out


def through_the_check(name: str, wires: list[bytes], repeats: int, expect: list[str]) -> dict:
    """Decode every rank's layout from its bytes, then run the coverage check over them."""
    decode_s, check_s = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        layouts = {
            r: wire.layout_from_pb(pb.Layout.FromString(data)) for r, data in enumerate(wires)
        }
        decode_s.append(time.perf_counter() - start)
        ctx = Context(
            cohort=SimpleNamespace(world_size=len(layouts)),  # type: ignore[arg-type]
            now=0.0,
            uploads_due=0.0,
            levels={"layout": Level.STRICT},
            layouts=layouts,
        )
        start = time.perf_counter()
        found = CoverageCheck().run(ctx, Level.STRICT).findings
        check_s.append(time.perf_counter() - start)
        kinds = [k for f in found for k in ("overlap", "uncovered") if f": {k}:" in f.text]
        assert kinds == expect, [f.text for f in found]
    pieces = sum(len(lay.pieces) for lay in layouts.values())
    return {
        "layout": name,
        "pieces": pieces,
        "ranks": len(wires),
        "wire_mb": round(sum(map(len, wires)) / 1e6, 1),
        "decode_s_median": statistics.median(decode_s),
        "check_s_median": statistics.median(check_s),
        "total_s_median": statistics.median(d + c for d, c in zip(decode_s, check_s, strict=True)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench/results/coverage.json"))
    args = parser.parse_args()
    n = args.pieces
    side = int(n**0.5)
    grid_i, grid_j = np.divmod(np.arange(side * side, dtype=np.int64), side)
    layouts = {
        # 1000 x 1000 blocks of one 2-D tensor (a TP x PP-style grid)
        "grid 2-D": (
            (side * 4, side * 2),
            np.arange(side * side, dtype=np.int64),
            np.stack([grid_i * 4, grid_j * 2], axis=1),
            np.tile(np.array([[4, 2]], dtype=np.int64), (side * side, 1)),
        ),
        # FSDP: flat ranges of one flattened buffer
        "flat ranges": (
            (n * 16,),
            np.arange(n, dtype=np.int64) % 4096,
            (np.arange(n, dtype=np.int64) * 16).reshape(n, 1),
            np.full((n, 1), 16, dtype=np.int64),
        ),
    }
    rows_n = max(2, round(n / 1000))
    wall_offsets, wall_lengths = bricks(rows_n, 2000)
    wall_ranks = np.arange(len(wall_offsets), dtype=np.int64) % 1024
    shifted = wall_offsets.copy()
    shifted[1001, 1] += 1  # row 1's second brick, one column right
    keep = np.ones(len(wall_offsets), dtype=bool)
    keep[5000] = False
    wall = (rows_n, 2000)
    layouts["brick wall"] = (wall, wall_ranks, wall_offsets, wall_lengths)
    layouts["wall shifted"] = (wall, wall_ranks, shifted, wall_lengths)
    layouts["wall gapped"] = (wall, wall_ranks[keep], wall_offsets[keep], wall_lengths[keep])
    expected = {"wall shifted": ["overlap", "uncovered"], "wall gapped": ["uncovered"]}
    rows = []
    for name, (shape, ranks, offsets, lengths) in layouts.items():
        columnar, objects = [], []
        pieces = [
            Piece(int(r), tuple(int(v) for v in o), tuple(int(v) for v in ln))
            for r, o, ln in zip(ranks, offsets, lengths, strict=True)
        ]
        for _ in range(args.repeats):
            start = time.perf_counter()
            problems = check_arrays("t", shape, ranks, offsets, lengths)
            columnar.append(time.perf_counter() - start)
            assert [p.kind for p in problems or []] == expected.get(name, []), problems
            start = time.perf_counter()
            assert [p.kind for p in check("t", shape, pieces)] == expected.get(name, [])
            objects.append(time.perf_counter() - start)
        rows.append(
            {
                "layout": name,
                "pieces": len(ranks),
                "columnar_s_median": statistics.median(columnar),
                "from_piece_objects_s_median": statistics.median(objects),
            }
        )
    print(f"{'layout':<13} {'pieces':>9} {'check (columns)':>16} {'incl. Piece objects':>20}")
    for r in rows:
        print(
            f"{r['layout']:<13} {r['pieces']:>9} {r['columnar_s_median']:>15.3f}s "
            f"{r['from_piece_objects_s_median']:>19.3f}s"
        )
    side3 = round(n ** (1 / 3))
    i, rest = np.divmod(np.arange(side3**3, dtype=np.int64), side3 * side3)
    j, k = np.divmod(rest, side3)
    grid3 = np.stack([i * 4, j * 4, k * 4], axis=1)
    cube = np.full((side3**3, 3), 4, dtype=np.int64)
    moved = grid3.copy()
    moved[len(moved) // 2, 0] += 1  # one block, one element along the first axis
    entry = [
        through_the_check("grid 3-D", one_tensor((side3 * 4,) * 3, grid3, cube), args.repeats, []),
        through_the_check("grid 3-D dealt", dealt((side3 * 4,) * 3, grid3, cube), args.repeats, []),
        through_the_check(
            "grid 3-D moved",
            dealt((side3 * 4,) * 3, moved, cube),
            args.repeats,
            ["overlap", "uncovered"],
        ),
        through_the_check("62,500 x tp=16", tp_split(max(1, n // 16), 16), args.repeats, []),
        through_the_check(
            "brick wall", one_tensor(wall, wall_offsets, wall_lengths), args.repeats, []
        ),
        through_the_check(
            "wall shifted",
            one_tensor(wall, shifted, wall_lengths),
            args.repeats,
            ["overlap", "uncovered"],
        ),
        through_the_check(
            "wall gapped",
            one_tensor(wall, wall_offsets[keep], wall_lengths[keep]),
            args.repeats,
            ["uncovered"],
        ),
    ]
    print()
    print("the coordinator's path: each rank's layout from its wire bytes, then CoverageCheck.run")
    print(
        f"{'layout':<15} {'pieces':>9} {'ranks':>5} {'wire':>7} {'decode':>8} {'check':>8} "
        f"{'total':>8}"
    )
    for r in entry:
        print(
            f"{r['layout']:<15} {r['pieces']:>9} {r['ranks']:>5} {r['wire_mb']:>5}MB "
            f"{r['decode_s_median']:>7.3f}s {r['check_s_median']:>7.3f}s "
            f"{r['total_s_median']:>7.3f}s"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"geometry": rows, "coordinator_path": entry}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
