"""What audits during training cost (issue 27).

1. On the rank: real `torchrun` jobs of 4 gloo ranks (CPU) running examples/train.py, with
   and without --audit (cohort.audit(model, step) after every step), against a real
   coordinator. Rank 0 prints its mean step time and the part of it the training thread
   spent in cohort.audit() (the digest of its weights, then a queue append: the gRPC call
   runs on the audit thread). Both at the example's width (--hidden 64, 6.5k parameters)
   and at a wider one (--hidden 1024, 1.1M parameters), where the digest shows.
2. On the coordinator: a real `cohortgate serve` process (history and metrics on, as in
   production) and real gRPC clients in --procs processes standing for N ranks, each rank
   sending its audit of every step, as the agent does: direct (one Audit call per rank and
   step) and through relays (one call per node of --node ranks and step, as a relay batches
   them). Coordinator CPU seconds per audited step (from /proc), and the steps per second
   it sustains while the clients send as fast as they can. Then the comparison alone
   (service/audits.py + decision/audit.py, in-process, no gRPC) per step at N ranks.

What differs from production: the simulated ranks of a client process share one channel
(production: one per rank); their steps are not paced by training, they send as fast as the
coordinator answers (so the figures are the coordinator's cost, not a step time).

Usage: python bench/bench_audit.py [--quick] [--ranks 4096] [--node 8] [--steps 20]
       [--procs 3] [--train-steps 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cohortgate.coordinator.cli.spawn import spawn  # noqa: E402

TRAIN = REPO / "examples" / "train.py"
STEP_LINE = re.compile(r"step time ([\d.]+) ms, of which cohort.audit ([\d.]+) ms")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def coordinator(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    flags = ["--metrics-listen", "127.0.0.1:0", "--history", str(tmp / "history.sqlite")]
    flags += ["--log-level", "warning"]
    proc, port = spawn(tmp / "port", flags, stdout=subprocess.DEVNULL, new_session=True)
    return proc, f"127.0.0.1:{port}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# -- 1. the rank's side ------------------------------------------------------------------
def train_once(addr: str, job: str, steps: int, hidden: int, audit: bool) -> tuple[float, float]:
    """(mean step ms, mean ms in cohort.audit) of rank 0 of a 4-rank torchrun job."""
    env = {**os.environ, "COHORTGATE_ADDR": addr, "COHORTGATE_JOB": job, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    command += ["--master-addr", "127.0.0.1", "--master-port", "0", str(TRAIN)]
    command += ["--steps", str(steps), "--hidden", str(hidden), "--quiet"]
    command += ["--audit"] if audit else []
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    found = STEP_LINE.search(out.stdout + out.stderr)
    if out.returncode or not found:
        raise RuntimeError(f"the training job failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    return float(found.group(1)), float(found.group(2))


def rank_side(steps: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = coordinator(Path(tmp))
        try:
            for hidden in (64, 1024):
                runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
                for i in range(repeats):
                    for audit in (False, True):
                        job = f"train-{hidden}-{audit}-{i}"
                        runs[audit].append(train_once(addr, job, steps, hidden, audit))
                plain = statistics.median(s for s, _ in runs[False])
                audited = statistics.median(s for s, _ in runs[True])
                in_audit = statistics.median(a for _, a in runs[True])
                params = 32 * hidden + hidden + hidden * hidden + hidden + hidden + 1
                rows.append(
                    {
                        "hidden": hidden,
                        "parameters": params,
                        "step_ms": plain,
                        "step_ms_audited": audited,
                        "audit_call_ms": in_audit,
                        "overhead_ms": audited - plain,
                    }
                )
        finally:
            stop(proc)
    return rows


# -- 2. the coordinator's side -----------------------------------------------------------
def _digest(step: int) -> bytes:
    return hashlib.sha256(str(step).encode()).digest()


def _client(args: tuple[str, str, int, int, list[int], int]) -> float:
    """Send the audits of `ranks` for every step; the seconds from first send to last reply."""
    addr, job, world, steps, ranks, node = args
    from grpc import aio

    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
    from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
    from cohortgate.coordinator.contract.digests import DIGEST_FORMAT_VERSION

    def audit(rank: int, step: int) -> pb.RankAudit:
        return pb.RankAudit(
            cohort_id=f"{job}/1/bench",
            job_id=job,
            round=1,
            rank=rank,
            world_size=world,
            host=f"node{rank // node}",
            incarnation=f"i{rank}",
            step=step,
            digest=_digest(step),
            digest_format=DIGEST_FORMAT_VERSION,
        )

    async def main() -> float:
        channel = aio.insecure_channel(addr)
        stub = pb_grpc.CohortServiceStub(channel)
        groups = [ranks[i : i + node] for i in range(0, len(ranks), node)]
        started = time.perf_counter()
        for step in range(steps):
            calls = [
                stub.Audit(pb.AuditRequest(audits=[audit(r, step) for r in g]), timeout=120)
                for g in groups
            ]
            await asyncio.gather(*calls)
        took = time.perf_counter() - started
        await channel.close()
        return took

    return asyncio.run(main())


def coordinator_side(world: int, node: int, steps: int, procs: int) -> dict[str, Any]:
    """`node` ranks per call (1: direct)."""
    job = f"audit-{world}-{node}-{time.time_ns()}"
    nodes = list(range(0, world, node))
    shares = [share for share in (nodes[i::procs] for i in range(procs)) if share]
    with tempfile.TemporaryDirectory() as tmp:
        proc, addr = coordinator(Path(tmp))
        try:
            work = [
                (addr, job, world, steps, [r for n in sh for r in range(n, n + node)], node)
                for sh in shares
            ]
            with mp.get_context("spawn").Pool(len(work)) as pool:
                cpu0, wall0 = cpu_s(proc.pid), time.perf_counter()
                took = pool.map(_client, work)
                cpu1, wall1 = cpu_s(proc.pid), time.perf_counter()
        finally:
            stop(proc)
    cpu = cpu1 - cpu0
    return {
        "ranks": world,
        "ranks_per_call": node,
        "calls_per_step": len(nodes),
        "steps": steps,
        "coordinator_cpu_ms_per_step": 1e3 * cpu / steps,
        "steps_per_s": steps / max(took),
        "wall_s": wall1 - wall0,
    }


def decision_only(world: int, node: int, steps: int) -> dict[str, Any]:
    """service/audits.py alone: submit() per call, as the servicer calls it."""
    from cohortgate.coordinator.decision.audit import RankAudit
    from cohortgate.coordinator.decision.formation import FormationOptions
    from cohortgate.coordinator.service.audits import Audits
    from cohortgate.coordinator.service.observers import Observer
    from cohortgate.coordinator.state.backends import open_verdicts

    async def main() -> float:
        audits = Audits(FormationOptions(), open_verdicts(None), Observer(), time.monotonic)
        batches = [
            [
                RankAudit("d/1/x", "d", 1, r, world, f"node{r // node}", "i", s, _digest(s))
                for r in range(n, min(n + node, world))
            ]
            for s in range(steps)
            for n in range(0, world, node)
        ]
        started = time.process_time()
        for batch in batches:
            audits.submit(batch)
        took = time.process_time() - started
        audits.close()
        return took

    cpu = asyncio.run(main())
    return {"ranks": world, "ranks_per_call": node, "cpu_ms_per_step": 1e3 * cpu / steps}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer steps and repeats (default: off)")
    p.add_argument("--ranks", type=int, default=4096, help="simulated ranks (default 4096)")
    p.add_argument("--node", type=int, default=8, help="ranks per relay call (default 8)")
    p.add_argument("--steps", type=int, default=20, help="audited steps (default 20)")
    p.add_argument("--procs", type=int, default=3, help="client processes (default 3)")
    p.add_argument("--train-steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--repeats", type=int, default=3, help="training runs each (default 3)")
    p.add_argument("--skip-train", action="store_true", help="coordinator only (default: off)")
    p.add_argument(
        "--json",
        type=Path,
        default=REPO / "bench" / "results" / "audit.json",
        help="where the figures go (default: bench/results/audit.json)",
    )
    args = p.parse_args()
    if args.quick:
        args.steps, args.train_steps, args.repeats = 5, 100, 1
    figures: dict[str, Any] = {}
    if not args.skip_train:
        figures["rank"] = rank_side(args.train_steps, args.repeats)
        print("rank side: 4 gloo ranks, examples/train.py, medians of", args.repeats, "runs")
        print(f"{'hidden':>7} {'params':>9} {'step ms':>8} {'audited':>8} {'in audit':>9}")
        for r in figures["rank"]:
            print(
                f"{r['hidden']:>7} {r['parameters']:>9} {r['step_ms']:>8.3f} "
                f"{r['step_ms_audited']:>8.3f} {r['audit_call_ms']:>9.3f}"
            )
    figures["coordinator"] = [
        coordinator_side(args.ranks, n, args.steps, args.procs) for n in (1, args.node)
    ]
    figures["decision"] = [decision_only(args.ranks, n, args.steps) for n in (1, args.node)]
    print(f"coordinator side: {args.ranks} ranks, {args.steps} steps, {args.procs} client procs")
    print(
        f"{'per call':>9} {'calls/step':>10} {'cpu ms/step':>12} {'steps/s':>8} {'decide ms':>10}"
    )
    for c, d in zip(figures["coordinator"], figures["decision"], strict=True):
        print(
            f"{c['ranks_per_call']:>9} {c['calls_per_step']:>10} "
            f"{c['coordinator_cpu_ms_per_step']:>12.1f} {c['steps_per_s']:>8.2f} "
            f"{d['cpu_ms_per_step']:>10.2f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
