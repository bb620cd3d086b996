"""The event loop under hostile load: gRPC health latency and another job's formation time
while two clients loop 1M-entry uploads for a cohort that does not exist (one as a single
30 MB message, one in chunks as an agent sends it) and a 10-rank job
with a 1M-piece non-grid layout (a brick wall) is checked for coverage.

Usage: python bench/bench_hostile.py [--entries 1000000] [--seconds 40] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb  # noqa: E402
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc  # noqa: E402
from cohortgate.coordinator.cli.spawn import spawn  # noqa: E402
from cohortgate.coordinator.codec import wire  # noqa: E402
from tests.helpers import join_request, manifest_of, run_cohort, save_figures  # noqa: E402

UPLOAD = "/cohortgate.v1.CohortService/UploadManifest"
CHUNKS = "/cohortgate.v1.CohortService/UploadManifestChunks"
ROWS, COLUMNS, RANKS = 990, 2000, 10  # 990 brick rows of ~1000 pieces: ~990k pieces


def hostile_uploads(addr: str, entries: int, chunked: bool, stop: Any, sent: Any) -> None:
    """A non-member's 1M-entry manifest, sent again and again: as one message (over the
    message limit), or in chunks as an agent sends it."""
    manifest = pb.Manifest(
        format=1,
        entries=[
            pb.ManifestEntry(kind=1, name=f"layers.{i}.w", dtype="float32", shape=[4, 4])
            for i in range(entries)
        ],
    )
    data = pb.UploadManifestRequest(
        job_id="nobody", round=1, rank=0, incarnation="x", signature=b"s" * 32, manifest=manifest
    )
    options = [("grpc.max_send_message_length", 256 << 20)]
    with grpc.insecure_channel(addr, options=options) as channel:
        call: Any = channel.unary_unary(UPLOAD)
        payload: Any = data.SerializeToString()
        if chunked:
            call = channel.stream_unary(CHUNKS, request_serializer=pb.UploadChunk.SerializeToString)
            chunks = list(wire.upload_chunks(data))
            payload = None
        while not stop.is_set():
            with contextlib.suppress(grpc.RpcError):  # refused, as it should be
                call(iter(chunks) if chunked else payload, timeout=60)
            with sent.get_lock():
                sent.value += 1


def _bricks(rank: int) -> list[pb.ShardPiece]:
    """Rank `rank`'s share of a brick wall over one (ROWS, COLUMNS) tensor: even rows split
    every 2 columns, odd rows offset by one, so no grid of slabs tiles it."""
    pieces, n = [], 0
    for row in range(ROWS):
        starts = range(0, COLUMNS, 2) if row % 2 == 0 else [0, *range(1, COLUMNS - 1, 2)]
        for start in starts:
            width = 1 if row % 2 and start in (0, COLUMNS - 1) else 2
            width = min(width, COLUMNS - start)
            if n % RANKS == rank:
                pieces.append(
                    pb.ShardPiece(
                        tensor="wall", shape=[ROWS, COLUMNS], offset=[row, start], length=[1, width]
                    )
                )
            n += 1
        if row % 2:
            if n % RANKS == rank:
                pieces.append(
                    pb.ShardPiece(
                        tensor="wall",
                        shape=[ROWS, COLUMNS],
                        offset=[row, COLUMNS - 1],
                        length=[1, 1],
                    )
                )
            n += 1
    return pieces


def coverage_job(addr: str, out: Any) -> None:
    """Ten ranks, one replica, ~99k pieces each: the coverage check walks ~990k pieces."""
    m = manifest_of()
    requests = []
    for r in range(RANKS):
        req = join_request("wall", r, RANKS, m)
        req.layout.CopyFrom(
            pb.Layout(format=1, sizes={"tp": RANKS}, position={"tp": r}, pieces=_bricks(r))
        )
        requests.append(req)
    options = [("grpc.max_send_message_length", 256 << 20)]
    results: list[float] = []

    def one(req: pb.JoinRequest) -> None:
        with grpc.insecure_channel(addr, options=options) as channel:
            stub = pb_grpc.CohortServiceStub(channel)
            for event in stub.Join(req, timeout=600):
                if event.WhichOneof("event") == "manifest_request":
                    stub.UploadManifestChunks(
                        wire.upload_chunks(
                            wire.manifest_answer(req, event.manifest_request.round, m)
                        ),
                        timeout=60,
                    )
                if event.WhichOneof("event") == "verdict":
                    results.append(time.time())
                    out.put(pb.Verdict.Outcome.Name(event.verdict.outcome))
                    return

    started = time.time()
    threads = [threading.Thread(target=one, args=(req,)) for req in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(max(results) - started)


def probe_health(addr: str, stop: threading.Event, latencies: list[float]) -> None:
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while not stop.is_set():
            start = time.perf_counter()
            stub.Check(health_pb2.HealthCheckRequest(), timeout=60)
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)


def probe_formation(addr: str, stop: threading.Event, times: list[float]) -> None:
    m = manifest_of()
    while not stop.is_set():
        start = time.perf_counter()
        results = run_cohort(addr, f"other-{uuid.uuid4().hex[:8]}", {0: m, 1: m}, timeout=120)
        assert all(r.verdict is not None for r in results), [r.error for r in results]
        times.append(time.perf_counter() - start)
        time.sleep(0.5)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(addr: str, seconds: float) -> dict[str, Any]:
    stop = threading.Event()
    health: list[float] = []
    formation: list[float] = []
    probes = [
        threading.Thread(target=probe_health, args=(addr, stop, health)),
        threading.Thread(target=probe_formation, args=(addr, stop, formation)),
    ]
    for t in probes:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in probes:
        t.join()
    return {
        "health_ms": {
            "p50": 1000 * statistics.median(health),
            "p99": 1000 * pct(health, 0.99),
            "max": 1000 * max(health),
            "samples": len(health),
        },
        "formation_2_ranks_ms": {
            "p50": 1000 * statistics.median(formation),
            "max": 1000 * max(formation),
            "samples": len(formation),
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--json", type=Path, default=Path("bench/results/hostile.json"))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="cohortgate-hostile-") as tmp:
        server, port = spawn(
            Path(tmp) / "port",
            ["--metrics-listen", "off", "--history", "off", "--log-level", "warning"],
            stdout=open(Path(tmp) / "log", "wb"),  # noqa: SIM115 (closed with the process)
        )
        addr = f"127.0.0.1:{port}"
        try:
            baseline = measure(addr, 5.0)
            stop, sent = ctx.Event(), ctx.Value("i", 0)
            out = ctx.Queue()
            senders = [
                ctx.Process(target=hostile_uploads, args=(addr, args.entries, chunked, stop, sent))
                for chunked in (False, True)
            ]
            job = ctx.Process(target=coverage_job, args=(addr, out))
            for p in senders:
                p.start()
            time.sleep(8.0)  # the senders have built their messages and are sending
            job.start()
            loaded = measure(addr, args.seconds)
            job.join(timeout=600)
            outcomes = [out.get(timeout=5) for _ in range(RANKS)]
            coverage_s = out.get(timeout=5)
            stop.set()
            for p in senders:
                p.join(timeout=120)
        finally:
            server.terminate()
            server.wait(timeout=30)
    row = {
        "baseline": baseline,
        "under_load": loaded,
        "hostile_uploads_sent": sent.value,
        "upload_entries": args.entries,
        "coverage_pieces": sum(len(_bricks(r)) for r in range(RANKS)),
        "coverage_job_s": coverage_s,
        "coverage_outcomes": sorted(set(outcomes)),
    }
    for name, m in (("baseline", baseline), ("under load", loaded)):
        h, f = m["health_ms"], m["formation_2_ranks_ms"]
        print(
            f"{name:<11} health p50 {h['p50']:.1f} ms p99 {h['p99']:.1f} ms max {h['max']:.1f} "
            f"ms ({h['samples']}); 2-rank cohort p50 {f['p50']:.0f} ms max {f['max']:.0f} ms "
            f"({f['samples']})"
        )
    said = (
        f"{row['hostile_uploads_sent']} non-member {args.entries}-entry uploads refused; the "
        f"{row['coverage_pieces']}-piece coverage job decided in {coverage_s:.1f}s "
        f"({', '.join(row['coverage_outcomes'])})"
    )
    return save_figures(args.json, row, said)


if __name__ == "__main__":
    sys.exit(main())
