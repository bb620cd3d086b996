"""What one beat call costs while a big job is stalled (issue 40, item 4).

`Stalls.beat` asks the cohort when it is next due on every call. One formed cohort of R ranks
(default 100,000) beating in calls of G ranks (default 64, a rack relay's), in process (no
gRPC, the in-memory history, the real metrics), through three phases of the same job:
  healthy   every rank moves a step each second;
  paused    every rank in an on-purpose pause (a checkpoint) past the stall bound;
  stalled   past the stall bound, no rank moves, every rank still beats (a hung collective):
            the stall is found, asked for snapshots, and 3 ranks in 4 have not answered yet.
Quoted: the median time of one beat call in each phase. Run it on two commits to compare.

Usage: python bench/bench_stalled.py [--ranks 100000] [--group 64] [--seconds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_sweep import Clock  # noqa: E402
from cohortgate.coordinator.decision.formation import FormationOptions  # noqa: E402
from cohortgate.coordinator.decision.stall import Beat, Snapshot  # noqa: E402
from cohortgate.coordinator.service.observers import Observer  # noqa: E402
from cohortgate.coordinator.service.stalls import Stalls  # noqa: E402
from cohortgate.coordinator.state.backends import open_verdicts  # noqa: E402

CID = "job/1/x"
BOUND_S = 3.0  # short, so that the old code's phases end (the cost per call is the same)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=100_000)
    p.add_argument("--group", type=int, default=64)
    p.add_argument("--seconds", type=int, default=3, help="seconds timed per phase (at most 4)")
    asyncio.run(run(p.parse_args()))


async def run(a: argparse.Namespace) -> None:
    """On a loop (the sweeper's timer is set on it), sweeping by hand."""
    clock = Clock()
    stalls = Stalls(FormationOptions(stall_after_s=BOUND_S), open_verdicts(None), Observer(), clock)
    groups = [range(g, min(g + a.group, a.ranks)) for g in range(0, a.ranks, a.group)]
    snap = Snapshot("train (t.py:9)", "all_reduce")

    def second(
        step: int, paused: str = "", wanted: int = 0, timed: list[float] | None = None
    ) -> None:
        clock.now += 1.0
        for ranks in groups:
            beats = [
                Beat(
                    CID,
                    "job",
                    1,
                    r,
                    a.ranks,
                    f"h{r // 8}",
                    f"i{r}",
                    step,
                    paused=paused,
                    stall_id=wanted,
                    snapshot=snap if wanted and r % 4 == 0 else None,
                )
                for r in ranks
            ]
            t = time.perf_counter()
            answers = stalls.beat(beats)
            if timed is not None:
                timed.append(time.perf_counter() - t)
        del answers
        stalls.sweep()

    phases: dict[str, list[float]] = {"healthy": [], "paused": [], "stalled": []}
    step = 0
    for i in range(a.seconds + 2):
        step += 1
        second(step, timed=phases["healthy"] if i >= 2 else None)
    for i in range(int(BOUND_S) + 1 + a.seconds):
        second(step, paused="checkpoint", timed=phases["paused"] if i > BOUND_S else None)
    for _ in range(int(BOUND_S) + 1):  # no progress past the bound: the stall is found
        second(step)
    wanted = next(iter(stalls.cohorts.values())).answer().snapshot_wanted
    assert wanted, "the bench's job should be stalled and asked for snapshots by now"
    for _ in range(a.seconds):  # within the snapshot wait (5 s): still asking
        second(step, wanted=wanted, timed=phases["stalled"])
    calls = len(groups)
    print(f"one cohort of {a.ranks} ranks beating in calls of {a.group} ({calls} calls a second):")
    for name, times in phases.items():
        us = statistics.median(times) * 1e6
        print(f"  {name:8} {us:10.1f} us a beat call (median of {len(times)})")
    stalls.close()


if __name__ == "__main__":
    main()
