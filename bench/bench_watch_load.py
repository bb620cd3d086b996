"""Watchers against formation: 300 jobs x 4 ranks (half refused: rank 3 builds a wider
model) reach their verdicts, with and without another process holding 100 WatchCohorts
streams on every job and looping ListCohorts. Prints p50/p99 time to verdict, the
coordinator's CPU seconds and the watch messages sent; the with/without ratio is the cost.

    python bench/bench_watch_load.py [--jobs 300] [--watchers 100] [--repeats 3]

The coordinator is a `cohortgate serve` subprocess with production settings (SQLite history,
metrics, info logs), `--watch-interval` at its default unless given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stress_restart import MANIFEST, one_join, request
from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.cli.spawn import spawn
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest

WIDE = Manifest.of(
    [
        Entry(Kind.PARAMETER, "fc.weight", "float32", (8, 8), True),
        Entry(Kind.PARAMETER, "fc.bias", "float32", (8,), True),
    ]
)


async def load(addr: str, jobs: int, world: int) -> list[float]:
    """Seconds from each rank's join to its verdict."""
    channels = [grpc.aio.insecure_channel(addr) for _ in range(16)]
    stubs = [pb_grpc.CohortServiceStub(ch) for ch in channels]
    tag = uuid.uuid4().hex[:6]

    async def rank(j: int, r: int) -> float:
        job = f"load-{tag}-{j}"
        req = request(job, r, world)
        manifest = MANIFEST
        if j % 2 and r == world - 1:
            manifest = WIDE
            req.signature = WIDE.signature()
        start = time.perf_counter()
        outcome, verdict = await one_join(stubs[(j * world + r) % 16], req, 300, manifest)
        if verdict is None:
            raise RuntimeError(f"{job} rank {r}: {outcome}")
        return time.perf_counter() - start

    tasks = [asyncio.create_task(rank(j, r)) for j in range(jobs) for r in range(world)]
    times = list(await asyncio.gather(*tasks))
    for ch in channels:
        await ch.close()
    return times


def watch(addr: str, watchers: int, ready: mp.Event, stop: mp.Event, sent: mp.Value) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        channel = grpc.aio.insecure_channel(addr)
        stub = pb_grpc.StatusServiceStub(channel)

        async def one() -> None:
            async for _ in stub.WatchCohorts(pb.WatchCohortsRequest()):
                with sent.get_lock():
                    sent.value += 1

        async def lister() -> None:
            while not stop.is_set():
                await stub.ListCohorts(pb.ListCohortsRequest(), timeout=60)

        tasks = [asyncio.create_task(one()) for _ in range(watchers)]
        tasks.append(asyncio.create_task(lister()))
        await asyncio.sleep(1.0)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await channel.close()

    asyncio.run(main())


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


def one_run(args: argparse.Namespace, with_watchers: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        flags = ["--history", f"{tmp}/h.sqlite", "--metrics-listen", "127.0.0.1:0"]
        flags += ["--log-format", "json", "--join-deadline", "300"]
        if args.watch_interval is not None:
            flags += ["--watch-interval", str(args.watch_interval)]
        log = open(Path(tmp) / "log", "wb")  # noqa: SIM115
        proc, port = spawn(Path(tmp) / "port", flags, stdout=log)
        addr = f"127.0.0.1:{port}"
        ready, stop, sent = mp.Event(), mp.Event(), mp.Value("q", 0)
        watcher = None
        try:
            if with_watchers:
                watcher = mp.Process(target=watch, args=(addr, args.watchers, ready, stop, sent))
                watcher.start()
                ready.wait(60)
            cpu0, start = cpu_s(proc.pid), time.perf_counter()
            times = asyncio.run(load(addr, args.jobs, 4))
            wall, cpu = time.perf_counter() - start, cpu_s(proc.pid) - cpu0
        finally:
            stop.set()
            if watcher is not None:
                watcher.join(10)
                watcher.kill()
            proc.terminate()
            proc.wait(30)
            log.close()
    times.sort()
    return {
        "p50_s": round(statistics.median(times), 3),
        "p99_s": round(times[int(len(times) * 0.99) - 1], 3),
        "wall_s": round(wall, 2),
        "coordinator_cpu_s": round(cpu, 2),
        "watch_messages": sent.value,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300, help="jobs of 4 ranks (default 300)")
    parser.add_argument("--watchers", type=int, default=100, help="watch streams (default 100)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved pairs (default 3)")
    parser.add_argument("--watch-interval", type=float, help="the coordinator's, if not default")
    parser.add_argument("--json", type=Path, default=Path("bench/results/watch_load.json"))
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"alone": [], "watched": []}
    for i in range(args.repeats):
        for name, watched in (("alone", False), ("watched", True)):
            row = one_run(args, watched)
            rows[name].append(row)
            print(f"repeat {i + 1} {name:8} {json.dumps(row)}", flush=True)
    med = {k: statistics.median(r["p99_s"] for r in v) for k, v in rows.items()}
    ratio = med["watched"] / med["alone"]
    print(f"p99 to verdict, medians: alone {med['alone']:.2f} s, watched {med['watched']:.2f} s")
    print(f"ratio {ratio:.2f} (target <= 1.5)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"runs": rows, "p99_ratio": round(ratio, 2)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
