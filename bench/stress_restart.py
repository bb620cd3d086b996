"""The restart race under load: 64 jobs x 8 simulated gRPC ranks, and in every fourth job
rank 7 joins, cancels its call and re-joins at once as a new incarnation (what a torchrun
restart does). Every rank of every job must end with one verdict, FORMED, one cohort.

    python bench/stress_restart.py --runs 20 --burners 2

Each run starts a fresh `cohortgate serve` (production settings: SQLite history, metrics,
info logs) and, with --burners, that many CPU-burning processes beside it. Prints one line
per run and a JSON summary; exits 1 if any rank of any run ended otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from coordinator.api.v1 import cohort_pb2 as pb
from coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from coordinator.cli.spawn import spawn
from coordinator.contract.manifest import Entry, Kind, Manifest
from tests.helpers import join_async, join_request

MANIFEST = Manifest.of(
    [
        Entry(Kind.PARAMETER, "fc.weight", "float32", (4, 8), True),
        Entry(Kind.PARAMETER, "fc.bias", "float32", (4,), True),
    ]
)


def request(job: str, rank: int, world: int) -> pb.JoinRequest:
    return join_request(
        job,
        rank,
        world,
        MANIFEST,
        host=f"{job}-host{rank // 4}",
        quiet=rank != 0,
        launch=f"{job}-store:29500",  # as torchrun's agents send it: one per launch
    )


async def one_join(
    stub: pb_grpc.CohortServiceStub,
    req: pb.JoinRequest,
    deadline_s: float,
    manifest: Manifest = MANIFEST,
) -> tuple[str, pb.Verdict | None]:
    return await join_async(stub, req, deadline_s, manifest)


async def restarted_rank(
    stub: pb_grpc.CohortServiceStub, job: str, world: int, rng: random.Random, deadline_s: float
) -> tuple[str, pb.Verdict | None]:
    """Joins, cancels once its join is in (or a moment later), re-joins at once as a new
    incarnation of the same rank."""
    first = stub.Join(request(job, world - 1, world), timeout=deadline_s)
    with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError):
        await asyncio.wait_for(first.read(), timeout=rng.uniform(0.0, 0.05) + 0.001)
    first.cancel()
    return await one_join(stub, request(job, world - 1, world), deadline_s)


async def run_load(addr: str, jobs: int, world: int, every: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    deadline_s = 90.0
    channels = [grpc.aio.insecure_channel(addr) for _ in range(16)]
    stubs = [pb_grpc.CohortServiceStub(ch) for ch in channels]
    tag = uuid.uuid4().hex[:6]
    tasks: dict[tuple[str, int], asyncio.Task[tuple[str, pb.Verdict | None]]] = {}
    for j in range(jobs):
        job = f"restart-{tag}-{j}"
        for r in range(world):
            stub = stubs[(j * world + r) % len(stubs)]
            await asyncio.sleep(rng.uniform(0, 0.002))
            if j % every == 0 and r == world - 1:
                coro = restarted_rank(stub, job, world, rng, deadline_s)
            else:
                coro = one_join(stub, request(job, r, world), deadline_s)
            tasks[(job, r)] = asyncio.create_task(coro)
    results = {k: await t for k, t in tasks.items()}
    for ch in channels:
        await ch.close()
    problems = []
    for j in range(jobs):
        job = f"restart-{tag}-{j}"
        outcomes = [results[(job, r)] for r in range(world)]
        errors = [(r, e) for r, (e, v) in enumerate(outcomes) if v is None]
        cohorts = {v.cohort_id for _, v in outcomes if v is not None}
        formed = all(v is not None and v.outcome == pb.Verdict.OUTCOME_FORMED for _, v in outcomes)
        if errors or len(cohorts) != 1 or not formed:
            problems.append(f"{job}: errors {errors}, {len(cohorts)} cohorts, formed={formed}")
    return problems


def burn() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs in a row (default 20)")
    parser.add_argument("--jobs", type=int, default=64, help="jobs per run (default 64)")
    parser.add_argument("--world", type=int, default=8, help="ranks per job (default 8)")
    parser.add_argument(
        "--every", type=int, default=4, help="every Nth job has a restarted rank (default 4)"
    )
    parser.add_argument(
        "--burners", type=int, default=2, help="CPU-burning processes beside (default 2)"
    )
    parser.add_argument("--log-dir", type=Path, help="keep each run's coordinator log here")
    args = parser.parse_args()
    burners = [mp.Process(target=burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    failed_runs = 0
    summary = []
    try:
        for run in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                log = open(Path(tmp) / "coordinator.log", "wb")  # noqa: SIM115
                proc, port = spawn(
                    Path(tmp) / "port",
                    [
                        "--history",
                        f"{tmp}/history.sqlite",
                        "--metrics-listen",
                        "127.0.0.1:0",
                        "--log-format",
                        "json",
                        "--join-deadline",
                        "120",
                    ],
                    stdout=log,
                )
                try:
                    start = time.monotonic()
                    problems = asyncio.run(
                        run_load(f"127.0.0.1:{port}", args.jobs, args.world, args.every, run)
                    )
                    took = time.monotonic() - start
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
                    log.close()
                    if args.log_dir is not None:
                        args.log_dir.mkdir(parents=True, exist_ok=True)
                        (args.log_dir / f"run{run}.log").write_bytes(
                            (Path(tmp) / "coordinator.log").read_bytes()
                        )
            failed_runs += bool(problems)
            summary.append({"run": run, "seconds": round(took, 2), "problems": problems})
            state = "ok" if not problems else f"{len(problems)} job(s) wrong"
            print(f"run {run + 1}/{args.runs}: {took:.1f} s, {state}", flush=True)
            for p in problems[:5]:
                print(f"  {p}", flush=True)
    finally:
        for b in burners:
            b.terminate()
    print(json.dumps({"runs": args.runs, "failed_runs": failed_runs, "results": summary}))
    return 1 if failed_runs else 0


if __name__ == "__main__":
    raise SystemExit(main())
