"""The restart race under load, shared by tests/test_restart_race.py and
bench/stress_restart.py: many jobs of simulated gRPC ranks join at once, and in every Nth
job rank `world - 1` is restarted: its first process's call ends and a new incarnation of
the same rank joins. Every rank of every job must end with one verdict, FORMED, one cohort."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from dataclasses import dataclass

import grpc

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from tests.helpers import join_async, join_request

MANIFEST = Manifest.of(
    [
        Entry(Kind.PARAMETER, "fc.weight", "float32", (4, 8), True),
        Entry(Kind.PARAMETER, "fc.bias", "float32", (4,), True),
    ]
)


@dataclass(frozen=True)
class Load:
    """jobs x world ranks; every `every`th job has its last rank restarted.

    shape "torchrun": the restart cancels its join once it is in (or a moment later) and
    re-joins at once, as torchrun's restart of a worker does. shape "lone": a process
    restarted alone (a node supervisor, a container restart, a harness): its first process
    dies right after its first event, whatever it is, and the new one joins 50 ms later,
    the job's ranks in any order. `launch`: the ranks name their launch as torchrun's do;
    False, none (started without torchrun). `relay`: the second half of every job's ranks
    (the restarted one among them) join through this address, a node relay."""

    jobs: int = 64
    world: int = 8
    every: int = 4
    shape: str = "torchrun"
    launch: bool = True
    deadline_s: float = 90.0
    relay: str = ""


def request(job: str, rank: int, load: Load) -> pb.JoinRequest:
    return join_request(
        job,
        rank,
        load.world,
        MANIFEST,
        host=f"{job}-host{rank // 4}",
        quiet=rank != 0,
        launch=f"{job}-store:29500" if load.launch else "",
    )


async def restarted_rank(
    stub: pb_grpc.CohortServiceStub, job: str, load: Load, rng: random.Random
) -> tuple[str, pb.Verdict | None]:
    """The restarted rank (see Load.shape): its second process's outcome."""
    rank = load.world - 1
    first = stub.Join(request(job, rank, load), timeout=load.deadline_s)
    lone = load.shape == "lone"
    wait = load.deadline_s if lone else rng.uniform(0.0, 0.05) + 0.001
    with contextlib.suppress(TimeoutError, grpc.aio.AioRpcError):
        await asyncio.wait_for(first.read(), timeout=wait)
    first.cancel()
    if lone:
        await asyncio.sleep(0.05)
    return await join_async(stub, request(job, rank, load), load.deadline_s, MANIFEST)


async def run_load(addr: str, load: Load, seed: int) -> list[str]:
    """Every job's problems (a rank with no verdict, more than one cohort, not FORMED)."""
    rng = random.Random(seed)
    channels = [grpc.aio.insecure_channel(addr) for _ in range(16)]
    relayed = [grpc.aio.insecure_channel(load.relay) for _ in range(4)] if load.relay else []
    stubs = [pb_grpc.CohortServiceStub(ch) for ch in channels]
    relay_stubs = [pb_grpc.CohortServiceStub(ch) for ch in relayed]
    tag = uuid.uuid4().hex[:6]
    tasks: dict[tuple[str, int], asyncio.Task[tuple[str, pb.Verdict | None]]] = {}
    for j in range(load.jobs):
        job = f"restart-{tag}-{j}"
        order = list(range(load.world))
        if load.shape == "lone":  # rank 7 may well be the first in
            rng.shuffle(order)
        for r in order:
            n = j * load.world + r
            behind = relay_stubs and r >= load.world // 2
            stub = relay_stubs[n % len(relay_stubs)] if behind else stubs[n % len(stubs)]
            await asyncio.sleep(rng.uniform(0, 0.002))
            if j % load.every == 0 and r == load.world - 1:
                coro = restarted_rank(stub, job, load, rng)
            else:
                coro = join_async(stub, request(job, r, load), load.deadline_s, MANIFEST)
            tasks[(job, r)] = asyncio.create_task(coro)
    results = {k: await t for k, t in tasks.items()}
    for ch in channels + relayed:
        await ch.close()
    problems = []
    for j in range(load.jobs):
        job = f"restart-{tag}-{j}"
        outcomes = [results[(job, r)] for r in range(load.world)]
        errors = [(r, e) for r, (e, v) in enumerate(outcomes) if v is None]
        cohorts = {v.cohort_id for _, v in outcomes if v is not None}
        formed = all(v is not None and v.outcome == pb.Verdict.OUTCOME_FORMED for _, v in outcomes)
        if errors or len(cohorts) != 1 or not formed:
            problems.append(f"{job}: errors {errors}, {len(cohorts)} cohorts, formed={formed}")
    return problems
