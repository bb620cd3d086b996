"""What bench_scale.py's harness shares between cohortgate's clients and its peers' (ports,
/proc readings, the model, processes released at once), and the peers themselves by the
same harness: torch's TCPStore (libuv) as a barrier, torchft's Lighthouse as a quorum, a
client per group of ranks."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_cpu_rss(pid: int) -> tuple[float, int]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1]) * 1024
    return cpu, hwm


def manifest_for(entries: int, variant: int) -> Any:
    from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest

    items = [
        Entry(Kind.PARAMETER, f"layers.{i // 4}.w{i % 4}", "bfloat16", (1024, 1024 + variant), True)
        for i in range(entries)
    ]
    return Manifest.of(items)


def join_request_of(job: str, r: int, world: int, m: Any) -> Any:
    from tests.helpers import join_request

    return join_request(job, r, world, m, host=f"node{r // 8}", pid=r, quiet=r != 0)


# -- peers: one thread per client, over a few processes ---------------------------------------
def _threads(
    ranks: list[int], clients: list[Any], body: Any, ready: Any, go: Any, out: Any
) -> None:
    """Run body(rank, client) on a thread per rank, all released at once by `go`; report the
    first and last start and the last finish to `out`."""
    sent: list[float] = []
    done: list[float] = []
    lock = threading.Lock()
    gate = threading.Event()

    def rank(r: int, client: Any) -> None:
        gate.wait()
        with lock:
            sent.append(time.time())
        body(r, client)
        with lock:
            done.append(time.time())

    threads = [
        threading.Thread(target=rank, args=(r, c)) for r, c in zip(ranks, clients, strict=True)
    ]
    for t in threads:
        t.start()
    ready.put(os.getpid())
    go.wait()
    gate.set()
    for t in threads:
        t.join()
    out.put({"first_sent": min(sent), "last_sent": max(sent), "last_verdict": max(done)})


def workers(target: Any, arg_lists: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """target(*args, ready, go, out) in a process per entry of `arg_lists`, released at once
    when all are ready; what each put on `out`."""
    ctx = mp.get_context("spawn")
    out, ready, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    workers = [ctx.Process(target=target, args=(*args, ready, go, out)) for args in arg_lists]
    for w in workers:
        w.start()
    for _ in workers:
        ready.get(timeout=600)
    go.set()
    results = [out.get(timeout=600) for _ in workers]
    for w in workers:
        w.join(timeout=60)
    return results


def _drive(system: str, n: int, procs: int, size: int, target: Any, *args: Any) -> dict[str, Any]:
    """target(*args, share, ready, go, out) in `procs` processes, a client per `size` ranks
    (`share`: the first rank of each of its groups); the timings of the run."""
    firsts = list(range(0, n, size))
    results = workers(target, [(*args, firsts[i::procs]) for i in range(procs)])
    first = min(r["first_sent"] for r in results)
    done = max(r["last_verdict"] for r in results)
    return {
        "system": system if size == 1 else f"{system}/{size}",
        "ranks": n,
        "first_join_to_done_s": done - first,
        "last_join_to_done_s": done - max(r["last_sent"] for r in results),
    }


# -- TCPStore barrier ------------------------------------------------------------------------
def _store_proc(
    port: int, world: int, size: int, ranks: list[int], ready: Any, go: Any, out: Any
) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    def connect(_: int) -> Any:
        return dist.TCPStore(
            "127.0.0.1",
            port,
            world,
            is_master=False,
            timeout=timedelta(seconds=300),
            use_libuv=True,
        )

    # Connected in parallel, before the clock starts.
    with ThreadPoolExecutor(64) as pool:
        stores = list(pool.map(connect, ranks))

    def barrier(first: int, store: Any) -> None:
        # One client for a node's `size` ranks: its signatures in one call, the count by
        # `size`; the client completing the count compares every signature.
        mine = range(first, min(first + size, world))
        store.multi_set([f"sig/{r}" for r in mine], ["a" * 64] * len(mine))
        if store.add("joined", len(mine)) == world:
            sigs = store.multi_get([f"sig/{i}" for i in range(world)])
            store.set("verdict", "formed" if len(set(sigs)) == 1 else "refused")
        store.wait(["verdict"])
        store.get("verdict")

    _threads(ranks, stores, barrier, ready, go, out)


def run_tcpstore(n: int, procs: int, size: int) -> dict[str, Any]:
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
    try:
        return _drive("tcpstore", n, procs, size, _store_proc, port, n, size)
    finally:
        del master


# -- torchft Lighthouse -----------------------------------------------------------------------
def torchft_module() -> Any:
    """torchft's Rust extension, loaded without the torchft package (which needs
    opentelemetry); None where torchft is not installed."""
    os.environ.setdefault("RUST_LOG", "error")  # torchft logs every client and quorum
    import importlib.util
    import site

    # the extension's name differs between torchft's wheels of 0.2.0
    for root in site.getsitepackages():
        for name in ("torchft_module", "_torchft"):
            for path in Path(root, "torchft").glob(f"{name}.*so"):
                spec = importlib.util.spec_from_file_location(name, path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return module
    return None


def _lighthouse_server(replicas: int, port_file: str) -> None:
    tft = torchft_module()
    server = tft.LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=replicas,
        join_timeout_ms=600_000,
        quorum_tick_ms=10,
        heartbeat_timeout_ms=600_000,
    )
    Path(port_file).write_text(server.address().rsplit(":", 1)[1])
    threading.Event().wait()


def _lighthouse_proc(
    port: int, world: int, size: int, ranks: list[int], ready: Any, go: Any, out: Any
) -> None:
    from datetime import timedelta

    tft = torchft_module()
    addr = f"http://127.0.0.1:{port}"  # loopback, whatever name the server reports
    with ThreadPoolExecutor(64) as pool:
        clients = list(
            pool.map(
                lambda _: tft.LighthouseClient(addr, connect_timeout=timedelta(seconds=60)), ranks
            )
        )

    def quorum(first: int, client: Any) -> None:
        # one replica group per node of `size` ranks
        size_here = min(size, world - first)
        client.quorum(
            replica_id=f"replica{first}", timeout=timedelta(seconds=600), world_size=size_here
        )

    _threads(ranks, clients, quorum, ready, go, out)


def run_lighthouse(n: int, procs: int, size: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        replicas = len(range(0, n, size))
        server = ctx.Process(target=_lighthouse_server, args=(replicas, str(port_file)))
        server.start()
        while not (port_file.exists() and port_file.read_text()):
            time.sleep(0.05)
        try:
            cpu0, _ = proc_cpu_rss(server.pid or 0)
            port = int(port_file.read_text())
            row = _drive("lighthouse", n, procs, size, _lighthouse_proc, port, n, size)
            cpu1, hwm = proc_cpu_rss(server.pid or 0)
        finally:
            server.kill()
            server.join()
    return {**row, "coordinator_cpu_s": cpu1 - cpu0, "coordinator_peak_rss_mib": hwm / 2**20}
