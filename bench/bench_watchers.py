"""Watchers and formation: job B's 32-rank cohort formation time with and without 3,000
idle WatchCohorts streams on job A (a change now wakes only its own job's watchers).

Usage: python bench/bench_watchers.py [--watchers 3000] [--ranks 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from tests.helpers import InProcessCoordinator, manifest_of, run_cohort, save_figures


def formation_s(addr: str, job: str, ranks: int, repeats: int) -> float:
    m = manifest_of()
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        results = run_cohort(addr, f"{job}-{i}", dict.fromkeys(range(ranks), m), timeout=120)
        assert all(r.verdict is not None for r in results), [r.error for r in results]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--watchers", type=int, default=3000)
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results/watchers.json"))
    args = parser.parse_args()
    c = InProcessCoordinator(
        join_deadline=120.0,
        progress_interval=0.2,
        max_watchers=args.watchers + 10,
        max_watchers_per_token=args.watchers + 10,
    )
    try:
        baseline = formation_s(c.addr, "b-alone", args.ranks, args.repeats)
        with grpc.insecure_channel(c.addr) as channel:
            stub = pb_grpc.StatusServiceStub(channel)
            watches = [
                stub.WatchCohorts(pb.WatchCohortsRequest(job_id="job-a"), timeout=600)
                for _ in range(args.watchers)
            ]
            give_up = time.monotonic() + 60
            while c.call(lambda: c.running.coordinator.watchers.open) < args.watchers:
                assert time.monotonic() < give_up, "the watches never opened"
                time.sleep(0.1)
            watched = formation_s(c.addr, "b-watched", args.ranks, args.repeats)
            for w in watches:
                w.cancel()
    finally:
        c.stop()
    row = {
        "watchers": args.watchers,
        "ranks": args.ranks,
        "baseline_s": baseline,
        "with_watchers_s": watched,
        "ratio": watched / baseline,
    }
    print(
        f"job B's {args.ranks}-rank cohort: {baseline * 1000:.0f} ms alone, "
        f"{watched * 1000:.0f} ms with {args.watchers} idle watchers on job A "
        f"({row['ratio']:.2f}x; medians of {args.repeats})"
    )
    return save_figures(args.json, row)


if __name__ == "__main__":
    sys.exit(main())
