"""Formation at scale: N simulated ranks (real gRPC clients, many per process) join one cohort.

Reports, per N: first join -> last verdict delivered, last join -> last verdict delivered,
coordinator CPU seconds and peak RSS, payload bytes on the wire (serialized protobuf, without
HTTP/2 framing), manifests uploaded. With --signatures S the ranks hold S different models in
S contiguous blocks (a bad image on some nodes), so the verdict is a refusal with S-1 diffs.
With --relay K the clients are simulated relays: each
joins K ranks in one JoinGroup call, as `cohortgate relay` does on a node of K ranks. The
relay's own hop (K local ranks -> relay -> coordinator and back) runs on every node in
parallel; it is measured once, with a real `cohortgate relay` and K real rank clients, and
added to the relay rows ("+hop" columns).

The coordinator runs with its production settings: history on (a SQLite file), metrics on,
info logs; only the join deadline is raised.

Peers, by the same harness in the same run, with the same grouping: each client stands for
K ranks (one node) for every system. torch's TCPStore (libuv) as a barrier: a client sets
its K signatures, adds K to the count and waits; the client that completes the count
compares every signature. torchft's Lighthouse: a quorum of N/K replica groups, one client
per group with world_size K (needs `pip install --no-deps torchft==0.2.0`; its Rust server
runs in its own process through torchft's LighthouseServer, because the torchft package
itself, and so its `torchft_lighthouse` script, needs opentelemetry, which we do not
install). What still differs: cohortgate ranks send a signature and a manifest size, are
asked for manifests when signatures differ, and receive a verdict message; TCPStore
clients exchange 64-byte strings; Lighthouse clients receive the quorum (every member).
The floor (--peers floor, bench/floor_server.py): the
same clients against a minimal grpc.aio server on our stubs and event loop, with the RPC
shape cohortgate ships, that only counts ranks and sends each call one verdict; the table
then says `cohortgate / floor` (our own code) and `floor / TCPStore` (the stack).
Prints a table and writes JSON.

Usage: python bench/bench_scale.py --quick
       python bench/bench_scale.py [--ranks 256,4096] [--relay 1] [--node 0] [--procs 3]
       [--signatures 1] [--entries 200] [--peers tcpstore,lighthouse,floor] [--repeats 3] [--bare]
       [--etcd local|ENDPOINTS] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from cohortgate.coordinator.cli.spawn import spawn
from cohortgate.coordinator.codec.groups import as_classes

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests.helpers, here and in the client processes (spawned)

from scale_harness import (  # noqa: E402
    free_port,
    join_request_of,
    manifest_for,
    proc_cpu_rss,
    run_lighthouse,
    run_tcpstore,
    torchft_module,
    workers,
)
from scale_hop import measure_hop  # noqa: E402
from scale_report import medians, print_table  # noqa: E402


# -- cohortgate ------------------------------------------------------------------------------
class _Clients:
    """One client process's simulated ranks or relays (see _client_proc)."""

    def __init__(self, job: str, world: int, entries: int, signatures: int, rpc: str) -> None:
        self.job, self.world, self.signatures, self.rpc = job, world, signatures, rpc
        self.manifests = {v: manifest_for(entries, v) for v in range(signatures)}
        self.stats: dict[str, Any] = {"sent": [], "verdict": [], "bytes": 0, "uploads": 0}
        self.stats["outcomes"] = {}
        self.uploads: list[asyncio.Future[None]] = []

    def manifest(self, rank: int) -> Any:
        return self.manifests[rank * self.signatures // self.world]

    async def member(self, stub: Any, ranks: list[int], relay: bool) -> None:
        """One rank's Join (no relay), or a relay's group of `ranks`, until the verdict."""
        from cohortgate.coordinator.api.v1 import cohort_pb2 as pb

        reqs = {r: join_request_of(self.job, r, self.world, self.manifest(r)) for r in ranks}
        stats = self.stats
        stats["sent"].append(time.time())
        async for event in self._events(stub, reqs, relay):
            stats["bytes"] += event.ByteSize()
            kind = event.WhichOneof("event")
            if kind == "manifest_request":
                self.uploads.append(asyncio.ensure_future(self._upload(stub, reqs, event)))
            elif kind == "verdict":
                stats["verdict"].append(time.time())
                stats["decided"] = event.verdict.decided_at_unix
                name = pb.Verdict.Outcome.Name(event.verdict.outcome)
                stats["outcomes"][name] = stats["outcomes"].get(name, 0) + len(ranks)
        await asyncio.gather(*self.uploads)

    def _events(self, stub: Any, reqs: dict[int, Any], relay: bool) -> AsyncIterator[Any]:

        if len(reqs) == 1 and not relay:
            (request,) = reqs.values()
            self.stats["bytes"] += request.ByteSize()
            return stub.Join(request, timeout=600)  # type: ignore[no-any-return]
        if self.rpc == "poll":
            return self._polled(stub, reqs)
        group = as_classes(reqs.values())  # as `cohortgate relay` sends a group
        self.stats["bytes"] += group.ByteSize()
        return stub.JoinGroup(group, timeout=600)  # type: ignore[no-any-return]

    async def _polled(self, stub: Any, reqs: dict[int, Any]) -> AsyncIterator[Any]:
        """As `cohortgate relay` joins upstream: JoinPoll until the verdict, the round
        pinned from progress, an ask's upload beside the next poll."""

        while True:
            group = as_classes(reqs.values())
            self.stats["bytes"] += group.ByteSize()
            event = await stub.JoinPoll(group, timeout=600)
            yield event
            kind = event.WhichOneof("event")
            if kind == "verdict":
                return
            if kind == "progress":
                for q in reqs.values():
                    q.round = event.progress.round

    async def _upload(self, stub: Any, reqs: dict[int, Any], event: Any) -> None:
        from cohortgate.coordinator.codec import wire

        r = event.manifest_request.rank
        up = wire.manifest_answer(reqs[r], event.manifest_request.round, self.manifest(r))
        self.stats["bytes"] += up.ByteSize()
        self.stats["uploads"] += 1
        await stub.UploadManifestChunks(wire.upload_chunks(up), timeout=60)


def _client_proc(
    addr: str,
    job: str,
    groups: list[tuple[int, list[int]]],
    relay: bool,
    rpc: str,
    world: int,
    entries: int,
    signatures: int,
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    import grpc

    from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc

    clients = _Clients(job, world, entries, signatures, rpc)

    async def main() -> None:
        # Separate connections (a local subchannel pool each): grpc otherwise shares one TCP
        # connection among all channels to the same target.
        channels = [
            grpc.aio.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(max(4, len(groups) // 64))
        ]
        stubs = [pb_grpc.CohortServiceStub(c) for c in channels]
        for c in channels:
            await c.channel_ready()
        ready.put(os.getpid())
        while not go.is_set():  # every process connected before the first join
            await asyncio.sleep(0.001)
        await asyncio.gather(
            *(clients.member(stubs[g % len(stubs)], ranks, relay) for g, ranks in groups)
        )
        for c in channels:
            await c.close()

    asyncio.run(main())
    stats = clients.stats
    out.put(
        {
            "first_sent": min(stats["sent"]),
            "last_sent": max(stats["sent"]),
            "last_verdict": max(stats["verdict"]),
            "decided": stats["decided"],
            "verdicts": len(stats["verdict"]),
            "bytes": stats["bytes"],
            "uploads": stats["uploads"],
            "outcomes": stats["outcomes"],
        }
    )


def _groups(n: int, size: int, procs: int) -> list[list[tuple[int, list[int]]]]:
    """Ranks in groups of `size` (consecutive ranks: one node), the groups dealt to procs."""
    groups = [(g, list(range(s, min(s + size, n)))) for g, s in enumerate(range(0, n, size))]
    return [groups[i::procs] for i in range(procs)]


FLOOR = [sys.executable, str(REPO / "bench" / "floor_server.py")]


def run_floor(
    n: int, procs: int, entries: int, relay: int = 1, rpc: str = "stream"
) -> dict[str, Any]:
    """The same clients against the floor of our stack (bench/floor_server.py)."""
    return run_cohortgate(n, procs, entries, 1, relay, floor=True, rpc=rpc)


def run_cohortgate(
    n: int,
    procs: int,
    entries: int,
    signatures: int,
    relay: int = 1,
    bare: bool = False,
    *,
    floor: bool = False,
    rpc: str = "stream",
    etcd: str = "",
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        # Production settings: history (SQLite) and metrics on, info logs (to /dev/null);
        # --bare turns them off, to measure what they cost.
        flags = ["--join-deadline", "600"] + (
            ["--metrics-listen", "off", "--history", "off", "--log-level", "warning"]
            if bare
            else [
                "--metrics-listen",
                f"127.0.0.1:{free_port()}",
                "--history",
                str(Path(tmp) / "history.sqlite"),
            ]
        )
        if etcd:  # one replica on etcd: the verdict history there, writes fenced
            flags += ["--etcd", etcd, "--etcd-prefix", f"/bench-{os.getpid()}-{time.time_ns()}/"]
        server, port = spawn(
            Path(tmp) / "port",
            [] if floor else flags,
            stdout=subprocess.DEVNULL,
            new_session=True,
            program=FLOOR if floor else None,
        )
        try:
            addr = f"127.0.0.1:{port}"
            if etcd:
                _wait_leading(addr)
            cpu0, _ = proc_cpu_rss(server.pid)
            results = workers(
                _client_proc,
                [
                    (addr, f"bench-{n}", s, relay > 1, rpc, n, entries, signatures)
                    for s in _groups(n, relay, procs)
                ],
            )
            cpu1, hwm = proc_cpu_rss(server.pid)
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
    name = "floor" if floor else ("cohortgate+etcd" if etcd else "cohortgate")
    return {
        "system": (name if relay == 1 else f"{name}/relay{relay}") + ("/bare" if bare else ""),
        "ranks": n,
        "first_join_to_done_s": done - first,
        "last_join_to_done_s": done - last_join,
        # The coordinator's clock: from its decision to the last rank holding the verdict.
        "decided_to_done_s": done - results[0]["decided"],
        "coordinator_cpu_s": cpu1 - cpu0,
        "coordinator_peak_rss_mib": hwm / 2**20,
        "payload_bytes": sum(r["bytes"] for r in results),
        "manifests_uploaded": sum(r["uploads"] for r in results),
        "verdicts": sum(r["verdicts"] for r in results),
        "outcomes": outcomes,
    }


def _wait_leading(addr: str) -> None:
    """Until the replica leads (its CohortService is SERVING)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    give_up = time.monotonic() + 30
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="cohortgate.v1.CohortService")
        while stub.Check(request, timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
            if time.monotonic() > give_up:
                raise RuntimeError(f"the replica at {addr} never led")
            time.sleep(0.05)


def _local_etcd(tmp: str) -> Any:
    """Debian's etcd on free loopback ports (make system-deps unpacks it into .venv/etcd)."""
    from tests.etcd import EtcdServer

    etcd_bin = REPO / ".venv" / "etcd" / "usr" / "bin"
    os.environ["PATH"] = f"{etcd_bin}:{os.environ['PATH']}"
    return EtcdServer(Path(tmp) / "etcd").start()


def _one_round(
    n: int, args: argparse.Namespace, peers: list[str], etcd: str, runs: dict[str, list[Any]]
) -> None:
    """One run of every system at `n` ranks (interleaved, so drift hits every one alike)."""
    same = (n, args.procs, args.entries, args.signatures, args.relay)
    runs["cohortgate"].append(run_cohortgate(*same, rpc=args.rpc))
    if etcd:
        runs.setdefault("cohortgate+etcd", []).append(
            run_cohortgate(*same, rpc=args.rpc, etcd=etcd)
        )
    if args.bare:
        runs.setdefault("bare", []).append(run_cohortgate(*same, True, rpc=args.rpc))
    if "floor" in peers:
        runs["floor"].append(run_floor(n, args.procs, args.entries, args.relay, args.rpc))
    if "tcpstore" in peers:
        runs["tcpstore"].append(run_tcpstore(n, args.procs, args.relay))
    if "lighthouse" in peers:
        runs["lighthouse"].append(run_lighthouse(n, args.procs, args.relay))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="256,4096")
    parser.add_argument("--relay", type=int, default=1, help="ranks per simulated relay (1: none)")
    parser.add_argument(
        "--node",
        type=int,
        default=0,
        help="relays of relays: the --relay K clients are rack relays over node relays of "
        "this many ranks (the hop is measured through both levels)",
    )
    parser.add_argument("--procs", type=int, default=3)
    parser.add_argument("--signatures", type=int, default=1)
    parser.add_argument("--entries", type=int, default=200)
    parser.add_argument(
        "--peers",
        default="tcpstore,lighthouse",
        help="comma list: tcpstore, lighthouse, floor (a minimal server on our stubs: the "
        "stack alone), none",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--rpc",
        choices=("poll", "stream"),
        default="stream",
        help="how the simulated relays join, for cohortgate and the floor alike: a "
        "JoinGroup stream (`cohortgate relay`'s default) or JoinPoll (--upstream-rpc poll)",
    )
    parser.add_argument(
        "--bare",
        action="store_true",
        help="also run the coordinator without history, metrics and info logs (their cost)",
    )
    parser.add_argument(
        "--etcd",
        default="",
        help="also run cohortgate as one replica on etcd (the cost of HA, beside SQLite in "
        "the same run): etcd endpoints, or 'local' to start Debian's etcd here",
    )
    parser.add_argument("--json", type=Path, default=Path("bench/results/scale.json"))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="about a minute: 256 and 4,096 ranks, relays of 8, TCPStore, one run each",
    )
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.relay, args.peers, args.repeats = "256,4096", 8, "tcpstore", 1
    # c10d looks up the name of every client socket for its logs; with no DNS server
    # reachable (as here) each lookup waits ~0.17 s, so 4096 TCPStore clients took minutes
    # to connect. Inherited by every worker; the timed part does no lookups.
    os.environ.setdefault("RES_OPTIONS", "timeout:0 attempts:0")
    peers = [p for p in args.peers.split(",") if p in ("tcpstore", "lighthouse", "floor")]
    if "lighthouse" in peers and torchft_module() is None:
        print("torchft is not installed (pip install --no-deps torchft==0.2.0): no Lighthouse")
        peers.remove("lighthouse")
    etcd_dir = tempfile.TemporaryDirectory()
    etcd_server = _local_etcd(etcd_dir.name) if args.etcd == "local" else None
    etcd = etcd_server.endpoint if etcd_server is not None else args.etcd
    rows: list[dict[str, Any]] = []
    for n in [int(x) for x in args.ranks.split(",")]:
        runs: dict[str, list[dict[str, Any]]] = {"cohortgate": []}
        runs.update({p: [] for p in peers})
        for _ in range(args.repeats):
            _one_round(n, args, peers, etcd, runs)
        rows += [medians(results) for results in runs.values()]
    if etcd_server is not None:
        etcd_server.stop()
    etcd_dir.cleanup()
    hop = measure_hop(args.relay, args.node) if args.relay > 1 else None
    print_table(rows, hop)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "machine": os.uname().machine,
                "cpus": os.cpu_count(),
                "argv": sys.argv[1:],
                "rows": rows,
                "relay_hop": hop,
            },
            indent=1,
        )
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
