"""Formation at scale: N simulated ranks (real gRPC clients, many per process) join one cohort.

Reports, per N: first join -> last verdict delivered, last join -> last verdict delivered,
coordinator CPU seconds and peak RSS, payload bytes on the wire (serialized protobuf, without
HTTP/2 framing), manifests uploaded; and, by the same harness, torch's TCPStore used as a
barrier (N clients set their signature and wait; the last to arrive compares). Prints a table
and writes JSON.

Usage: python bench/bench_scale.py [--ranks 256,4096] [--procs 3] [--signatures 1]
       [--entries 200] [--peers tcpstore] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from coordinator.spawn import spawn

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def manifest_for(entries: int, variant: int) -> Any:
    from coordinator.manifest import Entry, Kind, Manifest

    items = [
        Entry(Kind.PARAMETER, f"layers.{i // 4}.w{i % 4}", "bfloat16", (1024, 1024 + variant), True)
        for i in range(entries)
    ]
    return Manifest.of(items)


# -- cohortgate ------------------------------------------------------------------------------
def _client_proc(
    addr: str,
    job: str,
    ranks: list[int],
    world: int,
    entries: int,
    signatures: int,
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    import grpc

    from coordinator import wire
    from coordinator.api.v1 import cohort_pb2 as pb
    from coordinator.api.v1 import cohort_pb2_grpc as pb_grpc

    manifests = {v: manifest_for(entries, v) for v in range(signatures)}

    async def main() -> dict[str, Any]:
        channels = [grpc.aio.insecure_channel(addr) for _ in range(max(4, len(ranks) // 64))]
        stubs = [pb_grpc.CohortServiceStub(c) for c in channels]
        stats = {"sent": [], "verdict": [], "bytes": 0, "uploads": 0, "outcomes": {}}

        async def rank(r: int) -> None:
            m = manifests[r % signatures]
            stub = stubs[r % len(stubs)]
            req = pb.JoinRequest(
                protocol_version=wire.PROTOCOL_VERSION,
                job_id=job,
                rank=r,
                world_size=world,
                host=f"node{r // 8}",
                pid=r,
                incarnation=uuid.uuid4().hex,
                signature=m.signature(),
                manifest_entries=len(m),
                init_method="tcp://127.0.0.1:29500" if r == 0 else "",
            )
            stats["bytes"] += req.ByteSize()
            stats["sent"].append(time.time())
            async for event in stub.Join(req, timeout=300):
                stats["bytes"] += event.ByteSize()
                kind = event.WhichOneof("event")
                if kind == "manifest_request":
                    up = pb.UploadManifestRequest(
                        job_id=job,
                        round=event.manifest_request.round,
                        rank=r,
                        incarnation=req.incarnation,
                        signature=m.signature(),
                        manifest=wire.manifest_to_pb(m),
                    )
                    stats["bytes"] += up.ByteSize()
                    stats["uploads"] += 1
                    await stub.UploadManifest(up, timeout=60)
                elif kind == "verdict":
                    stats["verdict"].append(time.time())
                    name = pb.Verdict.Outcome.Name(event.verdict.outcome)
                    stats["outcomes"][name] = stats["outcomes"].get(name, 0) + 1

        for c in channels:
            await c.channel_ready()
        ready.put(os.getpid())
        while not go.is_set():  # every process connected before the first join
            await asyncio.sleep(0.001)
        await asyncio.gather(*(rank(r) for r in ranks))
        for c in channels:
            await c.close()
        return stats

    stats = asyncio.run(main())
    out.put(
        {
            "first_sent": min(stats["sent"]),
            "last_sent": max(stats["sent"]),
            "last_verdict": max(stats["verdict"]),
            "verdicts": len(stats["verdict"]),
            "bytes": stats["bytes"],
            "uploads": stats["uploads"],
            "outcomes": stats["outcomes"],
        }
    )


def _proc_cpu_rss(pid: int) -> tuple[float, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return cpu, hwm


def run_cohortgate(n: int, procs: int, entries: int, signatures: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        flags = [
            "--metrics-listen",
            "off",
            "--history",
            "off",
            "--log-level",
            "warning",
            "--log-format",
            "json",
            "--join-deadline",
            "600",
        ]
        server, port = spawn(Path(tmp) / "port", flags, stdout=subprocess.DEVNULL, new_session=True)
        try:
            addr = f"127.0.0.1:{port}"
            cpu0, _ = _proc_cpu_rss(server.pid)
            ctx = mp.get_context("spawn")
            out, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
            shares = [list(range(i, n, procs)) for i in range(procs)]
            workers = [
                ctx.Process(
                    target=_client_proc,
                    args=(addr, f"bench-{n}", s, n, entries, signatures, ready, go, out),
                )
                for s in shares
            ]
            for w in workers:
                w.start()
            for _ in workers:
                ready.get(timeout=300)
            go.set()
            results = [out.get(timeout=600) for _ in workers]
            for w in workers:
                w.join(timeout=60)
            cpu1, hwm = _proc_cpu_rss(server.pid)
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    first = min(r["first_sent"] for r in results)
    last_join = max(r["last_sent"] for r in results)
    done = max(r["last_verdict"] for r in results)
    outcomes: dict[str, int] = {}
    for r in results:
        for k, v in r["outcomes"].items():
            outcomes[k] = outcomes.get(k, 0) + v
    return {
        "system": "cohortgate",
        "ranks": n,
        "first_join_to_done_s": done - first,
        "last_join_to_done_s": done - last_join,
        "coordinator_cpu_s": cpu1 - cpu0,
        "coordinator_peak_rss_mib": hwm / 2**20,
        "payload_bytes": sum(r["bytes"] for r in results),
        "manifests_uploaded": sum(r["uploads"] for r in results),
        "verdicts": sum(r["verdicts"] for r in results),
        "outcomes": outcomes,
    }


# -- TCPStore barrier ------------------------------------------------------------------------
def _store_proc(port: int, ranks: list[int], world: int, ready: Any, go: Any, out: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    sent, done = [], []
    lock = threading.Lock()
    gate = threading.Event()

    stores = [
        dist.TCPStore(
            "127.0.0.1",
            port,
            world,
            is_master=False,
            timeout=timedelta(seconds=300),
            use_libuv=True,
        )
        for _ in ranks
    ]

    def rank(r: int, store: Any) -> None:
        gate.wait()
        with lock:
            sent.append(time.time())
        store.set(f"sig/{r}", "a" * 64)
        if store.add("joined", 1) == world:  # the last to arrive compares every signature
            sigs = store.multi_get([f"sig/{i}" for i in range(world)])
            store.set("verdict", "formed" if len(set(sigs)) == 1 else "refused")
        store.wait(["verdict"])
        store.get("verdict")
        with lock:
            done.append(time.time())

    threads = [
        threading.Thread(target=rank, args=(r, st)) for r, st in zip(ranks, stores, strict=True)
    ]
    for t in threads:
        t.start()
    ready.put(os.getpid())
    go.wait()
    gate.set()
    for t in threads:
        t.join()
    out.put({"first_sent": min(sent), "last_sent": max(sent), "last_verdict": max(done)})


def run_tcpstore(n: int, procs: int) -> dict[str, Any]:
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port()
    master = dist.TCPStore(
        "127.0.0.1",
        port,
        n,
        is_master=True,
        timeout=timedelta(seconds=300),
        use_libuv=True,
        wait_for_workers=False,
    )
    ctx = mp.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [list(range(i, n, procs)) for i in range(procs)]
    workers = [ctx.Process(target=_store_proc, args=(port, s, n, ready, go, out)) for s in shares]
    for w in workers:
        w.start()
    for _ in workers:
        ready.get(timeout=300)
    go.set()
    results = [out.get(timeout=600) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    del master
    first = min(r["first_sent"] for r in results)
    last_join = max(r["last_sent"] for r in results)
    done = max(r["last_verdict"] for r in results)
    return {
        "system": "tcpstore",
        "ranks": n,
        "first_join_to_done_s": done - first,
        "last_join_to_done_s": done - last_join,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="256,4096")
    parser.add_argument("--procs", type=int, default=3)
    parser.add_argument("--signatures", type=int, default=1)
    parser.add_argument("--entries", type=int, default=200)
    parser.add_argument("--peers", default="tcpstore", help="comma list: tcpstore, or none")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=Path("bench/results/scale.json"))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in args.ranks.split(",")]:
        runs = {
            "cohortgate": [
                run_cohortgate(n, args.procs, args.entries, args.signatures)
                for _ in range(args.repeats)
            ]
        }
        if "tcpstore" in args.peers:
            runs["tcpstore"] = [run_tcpstore(n, args.procs) for _ in range(args.repeats)]
        for results in runs.values():
            row = dict(results[0])
            for key in (
                "first_join_to_done_s",
                "last_join_to_done_s",
                "coordinator_cpu_s",
                "coordinator_peak_rss_mib",
            ):
                if key in row:
                    row[key] = statistics.median(r[key] for r in results)
            row["runs"] = results
            rows.append(row)
    print(
        f"{'system':<11} {'ranks':>6} {'first->done':>12} {'last->done':>11} "
        f"{'coord CPU':>10} {'peak RSS':>9} {'bytes':>12} {'uploads':>8}"
    )
    for r in rows:
        print(
            f"{r['system']:<11} {r['ranks']:>6} {r['first_join_to_done_s']:>11.3f}s "
            f"{r['last_join_to_done_s']:>10.3f}s "
            + (
                f"{r['coordinator_cpu_s']:>9.2f}s {r['coordinator_peak_rss_mib']:>7.0f}MiB "
                f"{r['payload_bytes']:>12} {r['manifests_uploaded']:>8}"
                if r["system"] == "cohortgate"
                else ""
            )
        )
    by = {(r["system"], r["ranks"]): r for r in rows}
    for n in sorted({r["ranks"] for r in rows}):
        if ("tcpstore", n) in by:
            ratio = (
                by[("cohortgate", n)]["first_join_to_done_s"]
                / by[("tcpstore", n)]["first_join_to_done_s"]
            )
            print(f"{n} ranks: cohortgate / TCPStore barrier (first join to done) = {ratio:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"machine": os.uname().machine, "cpus": os.cpu_count(), "rows": rows}, indent=1)
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
