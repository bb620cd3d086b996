"""Status reads over huge cohorts: ListCohorts and /metrics with 10 waiting cohorts of world
size 2^20, one rank joined each (a read used to cost O(world size) of the event loop).

Usage: python bench/bench_status.py [--cohorts 10] [--world 1048576] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from tests.helpers import InProcessCoordinator, join_request, manifest_of, save_figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cohorts", type=int, default=10)
    parser.add_argument("--world", type=int, default=1 << 20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("bench/results/status.json"))
    args = parser.parse_args()
    c = InProcessCoordinator(join_deadline=600.0, progress_interval=0.2)
    m = manifest_of()
    list_ms, metrics_ms = [], []
    with grpc.insecure_channel(c.addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        calls = [
            stub.Join(join_request(f"huge-{j}", 0, args.world, m), timeout=600)
            for j in range(args.cohorts)
        ]
        for call in calls:
            next(iter(call))  # joined and waiting
        status = pb_grpc.StatusServiceStub(channel)
        for _ in range(args.repeats):
            start = time.perf_counter()
            status.ListCohorts(pb.ListCohortsRequest(), timeout=60)
            list_ms.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            with urllib.request.urlopen(c.metrics_url + "/metrics", timeout=60) as reply:
                reply.read()
            metrics_ms.append((time.perf_counter() - start) * 1000)
        for call in calls:
            call.cancel()
    c.stop()
    row = {
        "cohorts": args.cohorts,
        "world_size": args.world,
        "list_cohorts_ms_median": statistics.median(list_ms),
        "metrics_ms_median": statistics.median(metrics_ms),
    }
    print(
        f"{args.cohorts} waiting cohorts of world size {args.world}, one rank each: "
        f"ListCohorts {row['list_cohorts_ms_median']:.1f} ms, /metrics "
        f"{row['metrics_ms_median']:.1f} ms (medians of {args.repeats})"
    )
    return save_figures(args.json, row)


if __name__ == "__main__":
    sys.exit(main())
