"""Coverage check cost: 1,000,000 pieces (a grid layout, flat FSDP-style ranges, and a brick
wall that no grid tiles: valid, with one brick shifted by a column (an overlap and a gap),
and with one brick missing). Medians of --repeats runs, each layout's runs back to back.

Usage: python bench/bench_coverage.py [--pieces 1000000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from coordinator.decision.coverage import Piece, check, check_arrays


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
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
