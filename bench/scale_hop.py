"""The relay's own hop, measured once for bench_scale.py (K local ranks -> a real
`cohortgate relay` -> the coordinator and back), added to its relay rows."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from scale_harness import join_request_of, manifest_for

from cohortgate.coordinator.cli.spawn import spawn


async def _hop_cohort(addrs: list[str], job: str, size: int) -> float:
    """`size` ranks (dealt in order over `addrs`) form one cohort: first join -> last
    verdict, answering manifest requests as the agent does."""
    import grpc

    from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
    from cohortgate.coordinator.codec import wire

    m = manifest_for(20, 0)
    channels = [grpc.aio.insecure_channel(a) for a in addrs]
    stubs = [pb_grpc.CohortServiceStub(c) for c in channels]

    async def rank(r: int) -> None:
        stub = stubs[r * len(stubs) // size]
        request = join_request_of(job, r, size, m)
        async for event in stub.Join(request, timeout=60):
            kind = event.WhichOneof("event")
            if kind == "manifest_request":
                up = wire.manifest_answer(request, event.manifest_request.round, m)
                await stub.UploadManifestChunks(wire.upload_chunks(up), timeout=60)
            elif kind == "verdict":
                return

    try:
        for channel in channels:
            await channel.channel_ready()
        start = time.perf_counter()
        await asyncio.gather(*(rank(r) for r in range(size)))
        return time.perf_counter() - start
    finally:
        for channel in channels:
            await channel.close()


def _relay(tmp: str, name: str, upstream: int, ranks: int) -> tuple[subprocess.Popen[bytes], int]:
    return spawn(
        Path(tmp) / f"{name}-port",
        ["--upstream", f"127.0.0.1:{upstream}", "--local-ranks", str(ranks)],
        stdout=subprocess.DEVNULL,
        new_session=True,
        command="relay",
    )


def measure_hop(size: int, node: int = 0, repeats: int = 15) -> dict[str, float]:
    """What relays add: `size` rank clients form a cohort of `size` through a real
    `cohortgate relay` (with `node`, through node relays of `node` ranks under it: relays
    of relays) and directly, alternately; medians of first join -> last verdict."""
    with tempfile.TemporaryDirectory() as tmp:
        server, port = spawn(
            Path(tmp) / "port",
            ["--metrics-listen", "off", "--history", "off"],
            stdout=subprocess.DEVNULL,
            new_session=True,
        )
        relay, relay_port = _relay(tmp, "relay", port, size)
        nodes = [
            _relay(tmp, f"node{i}", relay_port, node) for i in range(size // node if node else 0)
        ]
        entry = [f"127.0.0.1:{p}" for _, p in nodes] or [f"127.0.0.1:{relay_port}"]
        try:
            direct, relayed = [], []
            for i in range(repeats):
                direct.append(asyncio.run(_hop_cohort([f"127.0.0.1:{port}"], f"direct-{i}", size)))
                relayed.append(asyncio.run(_hop_cohort(entry, f"relay-{i}", size)))
        finally:
            for proc in [*(p for p, _ in nodes), relay, server]:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {
        "ranks": size,
        "node_relays_of": node,
        "direct_s_median": statistics.median(direct),
        "relayed_s_median": statistics.median(relayed),
        "hop_s": statistics.median(relayed) - statistics.median(direct),
    }
