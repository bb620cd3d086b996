"""Coverage check cost: 1,000,000 pieces (a grid layout and flat FSDP-style ranges).

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
            assert problems == [], problems
            start = time.perf_counter()
            assert check("t", shape, pieces) == []
            objects.append(time.perf_counter() - start)
        rows.append(
            {
                "layout": name,
                "pieces": len(ranks),
                "columnar_s_median": statistics.median(columnar),
                "from_piece_objects_s_median": statistics.median(objects),
            }
        )
    print(f"{'layout':<12} {'pieces':>9} {'check (columns)':>16} {'incl. Piece objects':>20}")
    for r in rows:
        print(
            f"{r['layout']:<12} {r['pieces']:>9} {r['columnar_s_median']:>15.3f}s "
            f"{r['from_piece_objects_s_median']:>19.3f}s"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
