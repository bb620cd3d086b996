"""Weight digest throughput against a plain copy of the same tensors, on CPU and (where
present) CUDA; on CUDA also checks that the CPU and CUDA digests of the same bytes agree.

What the ratio means: copy time / digest time over the same bytes. A copy reads every byte
and writes it again (twice the memory traffic of a digest, which only reads), so a ratio of
1 says the digest's arithmetic costs as much as one extra pass of writes, not that it is
free. Copy and digest alternate within each repeat (one does not get a warmer machine than
the other); the median ratio is printed with its spread over the repeats.

Usage: python bench/bench_digest.py [--mib 1024] [--tensors 64] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _paired(first: Any, second: Any, sync: Any, repeats: int) -> tuple[list[float], list[float]]:
    """Times of `first` and `second`, alternating, after one warm-up of each."""
    first()
    second()
    sync()
    a: list[float] = []
    b: list[float] = []
    for _ in range(repeats):
        for fn, times in ((first, a), (second, b)):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
    return a, b


def run(device: str, kernel: bool, mib: int, tensors: int, repeats: int) -> dict[str, Any]:
    import torch

    from cohortgate.agent.digest import tensor_digest

    gen = torch.Generator().manual_seed(0)
    per = mib * 2**20 // tensors // 2  # bfloat16 elements per tensor
    weights = [
        torch.randn(per, generator=gen).to(torch.bfloat16).to(device) for _ in range(tensors)
    ]
    targets = [torch.empty_like(w) for w in weights]
    nbytes = sum(w.numel() * w.element_size() for w in weights)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def copy() -> None:
        for w, t in zip(weights, targets, strict=True):
            t.copy_(w)

    def digest() -> None:
        for i, w in enumerate(weights):
            tensor_digest(f"w{i}", w, kernel=kernel)

    copies, digests = _paired(copy, digest, sync, repeats)
    ratios = [c / d for c, d in zip(copies, digests, strict=True)]
    t_copy, t_digest = statistics.median(copies), statistics.median(digests)
    row: dict[str, Any] = {
        "device": (
            f"cpu/{'C kernel' if kernel else 'torch ops'} x{torch.get_num_threads()}"
            if device == "cpu"
            else torch.cuda.get_device_name()
        ),
        "bytes": nbytes,
        "copy_gib_s": nbytes / t_copy / 2**30,
        "digest_gib_s": nbytes / t_digest / 2**30,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }
    if device == "cuda":
        row["cpu_cuda_agree"] = all(
            tensor_digest(f"w{i}", w) == tensor_digest(f"w{i}", w.cpu())
            for i, w in enumerate(weights[:4])
        )
    return row


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="total size of the weights")
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results/digest.json"))
    args = parser.parse_args()
    from cohortgate.agent.digest import KERNEL

    # The CPU twice: the fused C kernel (what a CPU tensor gets where it was built) and the
    # torch ops it falls back to (what every other device runs).
    paths = [("cpu", True), ("cpu", False)] if KERNEL else [("cpu", False)]
    if not KERNEL:
        print(
            "cohortgate.agent._digest (the C kernel) is not built here: CPU figures are torch ops'"
        )
    if torch.cuda.is_available():
        paths.append(("cuda", False))
    rows = [run(d, k, args.mib, args.tensors, args.repeats) for d, k in paths]
    print(
        f"{'device':<24} {'MiB':>6} {'copy':>10} {'digest':>10} {'ratio':>6} "
        f"(median of {args.repeats}, min-max)"
    )
    for r in rows:
        print(
            f"{r['device']:<24} {r['bytes'] / 2**20:>6.0f} {r['copy_gib_s']:>6.1f}GiB/s "
            f"{r['digest_gib_s']:>6.1f}GiB/s {r['ratio']:>6.2f} "
            f"({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
            + (
                f"  CPU and CUDA digests agree: {r['cpu_cuda_agree']}"
                if "cpu_cuda_agree" in r
                else ""
            )
        )
    if not torch.cuda.is_available():
        print("no CUDA device here: the CUDA figures and the CPU/CUDA agreement are not measured")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
