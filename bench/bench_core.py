"""The coordinator's own cost per cohort, without the transport: N ranks' requests (as bytes)
are decoded and validated as the servicer does, then join one in-process `Coordinator`
(rank 0 uploads the manifest it is asked for) until FORMED.
Prints the CPU seconds per cohort (min, median, max of --repeats) and writes JSON.

What it leaves out, on purpose: the network, gRPC and the servicer's plumbing (auth, the
stream's replies; bench_scale.py measures those end to end). What it is for: comparing two
versions of the coordinator on the same work, e.g. `PYTHONPATH=<other tree> python
bench/bench_core.py`; and, with several --group sizes (`--group 8,64`), what one call costs
per group size: the coordinator's work per JoinGroup of 64 ranks against one of 8 (issue
40's "work per call, not per rank").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.cli import logs
from cohortgate.coordinator.codec.groups import as_classes
from cohortgate.coordinator.codec.wire import DEFAULT_LIMITS
from cohortgate.coordinator.edge.joins import group_join_intents, join_intents
from cohortgate.coordinator.service.core import Coordinator
from tests.helpers import join_request, manifest_of, save_figures

M = manifest_of()


def calls_of(n: int, group: int, sent: str = "classes") -> list[tuple[str, bytes]]:
    """The requests of one cohort as they arrive: a Join each (group 1), else a JoinGroup of
    `group` ranks as a relay sends it (`sent`: classes of ranks, or one request per rank as
    older relays do; hosts of 8 ranks); rank 0 alone is loud, as agents join."""
    joins = [
        join_request("core", r, n, M, host=f"node{r // 8}", local_rank=r % 8, quiet=r != 0)
        for r in range(n)
    ]
    if group == 1:
        return [("Join", j.SerializeToString()) for j in joins]

    def group_of(members: list[pb.JoinRequest]) -> pb.JoinGroupRequest:
        return as_classes(members) if sent == "classes" else pb.JoinGroupRequest(members=members)

    return [
        ("JoinGroup", group_of(joins[first : first + group]).SerializeToString())
        for first in range(0, n, group)
    ]


async def one_cohort(n: int, group: int, sent: str = "classes") -> float:
    """CPU seconds from the first call's bytes to the last rank's verdict: the edge's
    decoding and validation, then the service core."""
    coordinator = Coordinator()
    calls = calls_of(n, group, sent)

    async def call(method: str, data: bytes) -> str:
        decode = join_intents if method == "Join" else group_join_intents
        _, intents = decode(data, DEFAULT_LIMITS)
        async for event in coordinator.join_group(intents):
            kind = type(event).__name__
            if kind == "UploadAsk":
                coordinator.upload(event.ref, M, M.signature())  # type: ignore[union-attr]
            elif kind == "Verdict":
                return str(event.outcome.value)  # type: ignore[union-attr]
        return "no verdict"

    started = time.process_time()
    outcomes = await asyncio.gather(*(call(*c) for c in calls))
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
    parser.add_argument(
        "--sent",
        choices=["classes", "members"],
        default="classes",
        help="how a group's ranks are sent: as classes (relays now) or one request per "
        "rank (older relays)",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=Path("bench/results/core.json"))
    args = parser.parse_args()
    logs.configure("json", "warning")
    rows, said = [], []
    for group in (int(g) for g in args.group.split(",")):
        runs = sorted(
            asyncio.run(one_cohort(args.ranks, group, args.sent)) for _ in range(args.repeats)
        )
        median = statistics.median(runs)
        calls = -(-args.ranks // group)
        rows.append(
            {
                "ranks": args.ranks,
                "group": group,
                "sent": args.sent,
                "cpu_s": runs,
                "median_cpu_s": median,
                "median_cpu_per_call_us": median / calls * 1e6,
            }
        )
        said.append(
            f"{args.ranks} ranks in calls of {group} (sent as {args.sent}), one cohort, "
            "in-process: CPU "
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
