"""Signature cost against a bare named_parameters() + named_buffers() walk, on the meta device.

Usage: python bench/bench_signature.py [--sizes 1000,10000,100000] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path


def build_model(n_tensors: int) -> object:
    """A transformer-like stack on the meta device: per block 2 Linear, 1 LayerNorm (6 tensors
    as parameters) plus a BatchNorm1d every 4th block (buffers), until n_tensors is reached."""
    import torch
    from torch import nn

    blocks = []
    count = 0
    with torch.device("meta"):
        i = 0
        while count < n_tensors:
            block = nn.Module()
            block.fc1 = nn.Linear(64, 256)
            block.fc2 = nn.Linear(256, 64)
            block.norm = nn.LayerNorm(64)
            count += 6
            if i % 4 == 3:
                block.bn = nn.BatchNorm1d(64)
                count += 5
            blocks.append(block)
            i += 1
        return nn.Sequential(*blocks)


def count_tensors(model: object) -> int:
    import torch

    assert isinstance(model, torch.nn.Module)
    return sum(1 for _ in model.named_parameters()) + sum(1 for _ in model.named_buffers())


def best_of(fn: object, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results/signature.json"))
    args = parser.parse_args()

    import torch

    import cohortgate

    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        model = build_model(size)
        n = count_tensors(model)

        def bare(model: object = model) -> None:
            for _ in model.named_parameters():  # type: ignore[attr-defined]
                pass
            for _ in model.named_buffers():  # type: ignore[attr-defined]
                pass

        def sign(model: object = model) -> None:
            cohortgate.manifest(model).signature()  # type: ignore[arg-type]

        sign()
        bare()
        walk_min, walk_med = best_of(bare, args.repeats)
        sig_min, sig_med = best_of(sign, args.repeats)
        rows.append(
            {
                "tensors": n,
                "walk_s_median": walk_med,
                "signature_s_median": sig_med,
                "walk_s_min": walk_min,
                "signature_s_min": sig_min,
                "ratio_median": sig_med / walk_med,
            }
        )
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}")
    header = f"{'tensors':>8} {'bare walk':>12} {'signature':>12} {'ratio':>7}"
    print(f"{header}  (medians of {args.repeats})")
    for r in rows:
        print(
            f"{r['tensors']:>8} {r['walk_s_median'] * 1e3:>10.2f}ms "
            f"{r['signature_s_median'] * 1e3:>10.2f}ms {r['ratio_median']:>7.2f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
