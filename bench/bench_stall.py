"""What stall detection costs (issue 39).

1. `cohort.step(n)` on the training thread: the agent's Auditor.mark() against a real
   coordinator (its background thread running and sending), per call, over a million calls.
2. The background thread at one step per 100 ms: the process's CPU (every thread: the
   sender, grpc's) while the main thread marks a step every 100 ms and otherwise sleeps.
3. The coordinator for N ranks (default 4096) marking a step every second, as the agents do,
   through relays of --node ranks (one Audit call per node and second, as a relay batches
   the marks that land on the same wall-clock second): a real `cohortgate serve` process
   (history and metrics on), real gRPC clients in --procs processes paced at one round a
   second. Coordinator CPU per second of that load (from /proc), and per round when the
   clients send as fast as it answers (its capacity).

What differs from production: the simulated ranks of a client process share one channel (a
relay has one upstream channel too, so through relays this is production's shape); no
training runs beside the clients.

Usage: python bench/bench_stall.py [--quick] [--ranks 4096] [--node 8] [--seconds 20]
       [--procs 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_audit import coordinator, cpu_s, stop  # noqa: E402


def _auditor(addr: str) -> Any:
    from cohortgate.agent.audit import Auditor
    from cohortgate.agent.torchrun import RankIdentity

    ident = RankIdentity(
        job_id="bench-step",
        rank=0,
        world_size=1,
        local_rank=0,
        host="bench",
        pid=0,
        incarnation="i0",
        restart_count=0,
        addr=addr,
        error_file=None,
        endpoint_host="127.0.0.1",
    )
    return Auditor(ident, "bench-step/1/x", 1, "")


def step_call(addr: str, calls: int) -> dict[str, Any]:
    auditor = _auditor(addr)
    auditor.mark(0)  # the sender starts
    time.sleep(1.5)
    started = time.perf_counter()
    for step in range(1, calls + 1):
        auditor.mark(step)
    took = time.perf_counter() - started
    return {"calls": calls, "us_per_call": 1e6 * took / calls}


def sender_cpu(addr: str, seconds: float) -> dict[str, Any]:
    auditor = _auditor(addr)
    auditor.mark(0)
    time.sleep(1.5)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    step = 1
    while time.perf_counter() - wall0 < seconds:
        auditor.mark(step)
        step += 1
        time.sleep(0.1)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {
        "steps": step,
        "seconds": wall,
        "process_cpu_ms_per_s": 1e3 * cpu / wall,
        "threads": threading.active_count(),
    }


def _client(args: tuple[str, str, int, list[int], int, int, bool]) -> float:
    """Mark a step for every rank of `ranks`, one call per node, once a second (`paced`) or
    as fast as answered, for `rounds` rounds; the seconds it took."""
    addr, job, world, ranks, node, rounds, paced = args
    from grpc import aio

    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
    from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc

    def mark(rank: int, step: int) -> pb.RankAudit:
        return pb.RankAudit(
            cohort_id=f"{job}/1/bench",
            job_id=job,
            round=1,
            rank=rank,
            world_size=world,
            host=f"node{rank // node}",
            incarnation=f"i{rank}",
            step=step,
            step_only=True,
            step_age_s=0.01,
        )

    async def main() -> float:
        channel = aio.insecure_channel(addr)
        stub = pb_grpc.CohortServiceStub(channel)
        groups = [ranks[i : i + node] for i in range(0, len(ranks), node)]
        started = time.perf_counter()
        for step in range(rounds):
            due = started + step
            if paced and due > time.perf_counter():
                await asyncio.sleep(due - time.perf_counter())
            calls = [
                stub.Audit(pb.AuditRequest(audits=[mark(r, step * 5) for r in g]), timeout=120)
                for g in groups
            ]
            await asyncio.gather(*calls)
        took = time.perf_counter() - started
        await channel.close()
        return took

    return asyncio.run(main())


def coordinator_side(world: int, node: int, rounds: int, procs: int, paced: bool) -> dict[str, Any]:
    job = f"stall-{world}-{node}-{time.time_ns()}"
    nodes = list(range(0, world, node))
    shares = [share for share in (nodes[i::procs] for i in range(procs)) if share]
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = coordinator(Path(tmp))
        try:
            work = [
                (addr, job, world, [r for n in sh for r in range(n, n + node)], node, rounds, paced)
                for sh in shares
            ]
            with mp.get_context("spawn").Pool(len(work)) as pool:
                cpu0, wall0 = cpu_s(proc.pid), time.perf_counter()
                took = pool.map(_client, work)
                cpu1, wall1 = cpu_s(proc.pid), time.perf_counter()
        finally:
            stop(proc)
    cpu, wall = cpu1 - cpu0, wall1 - wall0
    return {
        "ranks": world,
        "ranks_per_call": node,
        "calls_per_round": len(nodes),
        "rounds": rounds,
        "paced": paced,
        "coordinator_cpu_ms_per_round": 1e3 * cpu / rounds,
        "coordinator_cpu_share": cpu / wall,
        "rounds_per_s": rounds / max(took),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer calls and seconds (default: off)")
    p.add_argument("--ranks", type=int, default=4096, help="simulated ranks (default 4096)")
    p.add_argument("--node", type=int, default=8, help="ranks per relay call (default 8)")
    p.add_argument("--seconds", type=int, default=20, help="rounds of marks (default 20)")
    p.add_argument("--procs", type=int, default=3, help="client processes (default 3)")
    p.add_argument(
        "--json",
        type=Path,
        default=REPO / "bench" / "results" / "stall.json",
        help="where the figures go (default: bench/results/stall.json)",
    )
    args = p.parse_args()
    calls = 100_000 if args.quick else 1_000_000
    seconds = 5 if args.quick else args.seconds
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = coordinator(Path(tmp))
        try:
            figures["step_call"] = step_call(addr, calls)
            figures["sender"] = sender_cpu(addr, seconds)
        finally:
            stop(proc)
    # the two agents' senders now say once that the stopped coordinator is gone: not news
    logging.getLogger("cohortgate.agent").setLevel(logging.CRITICAL)
    s, b = figures["step_call"], figures["sender"]
    print(f"cohort.step(): {s['us_per_call']:.3f} us a call ({s['calls']} calls)")
    print(
        f"background thread at 1 step/100 ms: {b['process_cpu_ms_per_s']:.2f} ms CPU a second "
        f"(the whole process, {b['steps']} steps over {b['seconds']:.0f} s)"
    )
    figures["coordinator"] = [
        coordinator_side(args.ranks, args.node, seconds, args.procs, paced=True),
        coordinator_side(args.ranks, args.node, seconds, args.procs, paced=False),
    ]
    print(f"coordinator: {args.ranks} ranks through relays of {args.node}, {seconds} rounds")
    for c in figures["coordinator"]:
        how = "paced 1/s" if c["paced"] else "flat out"
        print(
            f"  {how:>9}: {c['calls_per_round']} calls a round, "
            f"{c['coordinator_cpu_ms_per_round']:.1f} ms CPU a round "
            f"({100 * c['coordinator_cpu_share']:.1f}% of a core), "
            f"{c['rounds_per_s']:.2f} rounds/s"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
