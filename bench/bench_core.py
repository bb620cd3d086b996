"""The service core's own cost per cohort, without gRPC: N ranks join one in-process
`Coordinator` through `join()` (rank 0 uploads the manifest it is asked for) until FORMED.
Prints the CPU seconds per cohort (min, median, max of --repeats) and writes JSON.

What it leaves out, on purpose: the network, protobuf and the servicer (bench_scale.py
measures those end to end). What it is for: comparing two versions of the service core on
the same work, e.g. `PYTHONPATH=<other tree> python bench/bench_core.py`; and, with several
--group sizes (`--group 8,64`), what one call costs per group size: the service's work per
JoinGroup of 64 ranks against one of 8 (issue 40's "work per call, not per rank").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cohortgate.coordinator.cli import logs
from cohortgate.coordinator.service.core import Coordinator
from cohortgate.coordinator.state.base import JoinIntent
from tests.helpers import manifest_of, member_of, save_figures

M = manifest_of()


async def one_cohort(n: int, group: int) -> float:
    """CPU seconds from the first join to the last rank's verdict; the ranks join in calls
    of `group` (a relay's JoinGroup; 1: one Join per rank)."""
    coordinator = Coordinator()

    def intent(r: int) -> JoinIntent:
        return JoinIntent("core", 0, member_of(r, M), n, quiet=r != 0)

    async def call(first: int) -> str:
        intents = [intent(r) for r in range(first, min(first + group, n))]
        async for event in coordinator.join_group(intents):
            kind = type(event).__name__
            if kind == "UploadAsk":
                coordinator.upload(event.ref, M, M.signature())  # type: ignore[union-attr]
            elif kind == "Verdict":
                return str(event.outcome.value)  # type: ignore[union-attr]
        return "no verdict"

    started = time.process_time()
    outcomes = await asyncio.gather(*(call(r) for r in range(0, n, group)))
    took = time.process_time() - started
    assert set(outcomes) == {"formed"}, set(outcomes)
    coordinator.close()
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument(
        "--group",
        default="1",
        help="ranks per call (a relay's group; 1: one Join per rank); "
        "several, comma-separated, to compare the cost of one call across sizes",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=Path("bench/results/core.json"))
    args = parser.parse_args()
    logs.configure("json", "warning")
    rows, said = [], []
    for group in (int(g) for g in args.group.split(",")):
        runs = sorted(asyncio.run(one_cohort(args.ranks, group)) for _ in range(args.repeats))
        median = statistics.median(runs)
        calls = -(-args.ranks // group)
        rows.append(
            {
                "ranks": args.ranks,
                "group": group,
                "cpu_s": runs,
                "median_cpu_s": median,
                "median_cpu_per_call_us": median / calls * 1e6,
            }
        )
        said.append(
            f"{args.ranks} ranks in calls of {group}, one cohort, in-process: CPU "
            f"{runs[0]:.3f} / {median:.3f} / {runs[-1]:.3f} s (min / median / max of "
            f"{args.repeats}); {median / calls * 1e6:.0f} us per call"
        )
    if len(rows) > 1:
        first, last = rows[0], rows[-1]
        ratio = last["median_cpu_per_call_us"] / first["median_cpu_per_call_us"]
        said.append(f"one call of {last['group']} / one call of {first['group']}: {ratio:.2f}")
    return save_figures(args.json, rows if len(rows) > 1 else rows[0], "\n".join(said))


if __name__ == "__main__":
    sys.exit(main())
