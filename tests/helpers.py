"""Test helpers: a real coordinator on a free loopback port, and raw gRPC ranks."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.codec.channel import ClientSecurity
from cohortgate.coordinator.contract.digests import DIGEST_FORMAT_VERSION
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from cohortgate.coordinator.decision.cohort import Member
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import Decision
from cohortgate.coordinator.edge.config import ServeConfig
from cohortgate.coordinator.edge.server import RunningServer, start
from cohortgate.coordinator.state.base import CohortStore, LiveCohort

REPO = Path(__file__).resolve().parent.parent
T = TypeVar("T")


class _Shared:
    """The test process's one loop (see shared_loop), made once under the lock, with the
    channel that pins grpc's state to it."""

    lock = threading.Lock()
    loop: asyncio.AbstractEventLoop | None = None
    pin: object = None


def shared_loop() -> asyncio.AbstractEventLoop:
    """The one event loop of this test process that every in-process grpc.aio server and
    client runs on, on a daemon thread, never stopped.

    grpc.aio binds its process-wide completion-queue poller to the loop that was running
    when it was first used, and hands every other loop its events from there. A loop that
    stops or closes (a coordinator's, asyncio.run's) while that state lives on leaves every
    later grpc.aio call of the process without events: it hangs to its deadline ("Event
    loop is closed" in grpc's _handle_events). One loop that lives as long as the process,
    holding a channel so that grpc's state is bound to it first, cannot."""
    with _Shared.lock:
        if _Shared.loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="test-loop", daemon=True).start()

            async def pin() -> object:
                return grpc.aio.insecure_channel("127.0.0.1:9")

            _Shared.pin = asyncio.run_coroutine_threadsafe(pin(), loop).result(timeout=30)
            _Shared.loop = loop
        return _Shared.loop


def run_async(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """`asyncio.run(coro)` for tests, on the shared loop (see shared_loop)."""
    return asyncio.run_coroutine_threadsafe(coro, shared_loop()).result(timeout=timeout)


class InProcessCoordinator:
    """A real grpc.aio server on 127.0.0.1:0, on the test process's shared event loop."""

    def __init__(self, **config: Any) -> None:
        config.setdefault("metrics_listen", "127.0.0.1:0")
        config.setdefault("history", ":memory:")
        config.setdefault("listen", "127.0.0.1:0")
        self.config = ServeConfig(**config)
        self.loop = shared_loop()
        self.running: RunningServer = run_async(start(self.config), timeout=30)
        self.addr = f"127.0.0.1:{self.running.port}"
        self.metrics_url = f"http://127.0.0.1:{self.running.metrics_port}"
        self._stopped = False

    def call(self, fn: Any, *args: Any) -> Any:
        """Run fn(*args) on the server's loop (for reading its state safely)."""

        async def run() -> Any:
            return fn(*args)

        return run_async(run(), timeout=10)

    def stop(self) -> None:
        """Stops it (once: a test that stopped it on purpose leaves its fixture's stop)."""
        if not self._stopped:
            self._stopped = True
            run_async(self.running.stop(0.5), timeout=30)


def wait_until(what: str, condition: Callable[[], object], within: float) -> float:
    """Seconds until `condition()` held; fails naming `what` after `within`."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < within, f"{what}: not within {within:g}s"
        time.sleep(0.05)
    return time.monotonic() - start


def wait_joined(addr: str, job: str, ranks: int, within: float = 20) -> None:
    """Until the coordinator at `addr` holds `ranks` ranks of `job`'s latest round (its
    status API). A test that needs one rank in before the next waits for it: a thread's
    first channel can take longer than a fixed sleep on a busy machine."""
    give_up = time.monotonic() + within
    while joined(addr, job) < ranks:
        assert time.monotonic() < give_up, f"{job}: {ranks} ranks never joined"
        time.sleep(0.02)


def joined(addr: str, job: str) -> int:
    """How many ranks the coordinator at `addr` holds in `job`'s latest round now."""
    with grpc.insecure_channel(addr) as channel:
        found = pb_grpc.StatusServiceStub(channel).ListCohorts(
            pb.ListCohortsRequest(job_id=job), timeout=5
        )
    return found.cohorts[-1].joined if found.cohorts else 0


def manifest_of(width: int = 4, dtype: str = "float32", extra: int = 0) -> Manifest:
    entries = [
        Entry(Kind.PARAMETER, "fc.weight", dtype, (width, 8), True),
        Entry(Kind.PARAMETER, "fc.bias", dtype, (width,), True),
    ]
    entries += [Entry(Kind.PARAMETER, f"extra{i}", dtype, (2,), True) for i in range(extra)]
    entries.append(Entry(Kind.BUFFER, "steps", "int64", ()))
    return Manifest.of(entries)


@dataclass
class RankResult:
    rank: int
    verdict: pb.Verdict | None = None
    error: grpc.RpcError | None = None
    upload_error: grpc.RpcError | None = None
    progress: list[pb.Progress] = field(default_factory=list)
    manifest_requests: int = 0
    digest_requests: list[int] = field(default_factory=list)  # the rank each one named


def join_request(
    job: str, rank: int, world: int, manifest: Manifest, **overrides: Any
) -> pb.JoinRequest:
    fields = {
        "protocol_version": wire.PROTOCOL_VERSION,
        "job_id": job,
        "world_size": world,
        "local_rank": rank,
        **_rank_fields(rank, manifest),
        **overrides,
    }
    return pb.JoinRequest(**fields)


def _rank_fields(rank: int, manifest: Manifest) -> dict[str, Any]:
    """Who a test rank is (a fresh incarnation; rank 0 offers the rendezvous)."""
    return {
        "rank": rank,
        "host": f"host{rank // 4}",
        "pid": 1000 + rank,
        "incarnation": uuid.uuid4().hex,
        "signature": manifest.signature(),
        "manifest_entries": len(manifest),
        "init_method": "tcp://127.0.0.1:29999" if rank == 0 else "",
    }


async def join_async(
    stub: pb_grpc.CohortServiceStub,
    req: pb.JoinRequest,
    deadline_s: float,
    manifest: Manifest,
    *,
    retry: bool = True,
) -> tuple[str, pb.Verdict | None]:
    """Join on an asyncio channel as the agent does: upload when asked, follow the round,
    and (`retry`) retry ALREADY_EXISTS (a predecessor not yet dropped) and UNAVAILABLE for
    a while. ('ok', verdict), or (the error's code and details, None)."""
    give_up = time.monotonic() + deadline_s
    while True:
        try:
            async for event in stub.Join(req, timeout=max(give_up - time.monotonic(), 0.1)):
                kind = event.WhichOneof("event")
                if kind == "manifest_request":
                    answer = wire.manifest_answer(req, event.manifest_request.round, manifest)
                    await stub.UploadManifestChunks(wire.upload_chunks(answer), timeout=60)
                elif kind == "progress":
                    req.round = event.progress.round
                elif kind == "verdict":
                    return "ok", event.verdict
            return "ended without a verdict", None
        except grpc.aio.AioRpcError as exc:
            again = exc.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.UNAVAILABLE)
            if retry and again and time.monotonic() < give_up - 1:
                await asyncio.sleep(0.2)
                continue
            return f"{exc.code().name}: {(exc.details() or '')[:160]}", None


def run_rank(
    addr: str,
    request: pb.JoinRequest,
    manifest: Manifest,
    timeout: float = 30.0,
    upload: Manifest | None = None,
    security: ClientSecurity | None = None,
) -> RankResult:
    """One rank: join, upload when asked, collect progress, return the verdict or error.
    `security`: TLS to present (default: a plain-text channel)."""
    result = RankResult(request.rank)
    with (security or ClientSecurity()).channel(addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        try:
            for event in stub.Join(request, timeout=timeout):
                kind = event.WhichOneof("event")
                if kind == "progress":
                    result.progress.append(event.progress)
                elif kind == "digest_request":  # not answered: its ranks' digests go unsent
                    result.digest_requests.append(event.digest_request.rank)
                elif kind == "manifest_request":
                    result.manifest_requests += 1
                    sent = upload or manifest
                    try:
                        stub.UploadManifestChunks(  # as the agent sends it
                            wire.upload_chunks(
                                wire.manifest_answer(request, event.manifest_request.round, sent)
                            ),
                            timeout=timeout,
                        )
                    except grpc.RpcError as exc:  # as the agent does: keep waiting
                        result.upload_error = exc
                elif kind == "verdict":
                    result.verdict = event.verdict
        except grpc.RpcError as exc:
            result.error = exc
    return result


def run_cohort(
    addr: str,
    job: str,
    manifests: dict[int, Manifest],
    world: int | None = None,
    timeout: float = 30.0,
    **overrides: Any,
) -> list[RankResult]:
    """Every rank of `manifests` joins at once; `overrides`: JoinRequest fields for all (a
    second run of a job right after its verdict names its own `launch`, as torchrun's do:
    without one, a new process of a just-decided rank on its host is its successor)."""
    world = world or len(manifests)
    with ThreadPoolExecutor(max_workers=len(manifests)) as pool:
        futures = [
            pool.submit(run_rank, addr, join_request(job, r, world, m, **overrides), m, timeout)
            for r, m in manifests.items()
        ]
        return [f.result() for f in futures]


def one_cohort(results: list[RankResult], outcome: int) -> pb.Verdict:
    """Every rank got a verdict of `outcome`, without an error, for one and the same cohort;
    that verdict."""
    for r in results:
        assert r.error is None, r.error
        assert r.verdict is not None and r.verdict.outcome == outcome, r.verdict
    assert len({r.verdict.cohort_id for r in results if r.verdict}) == 1
    verdict = results[0].verdict
    assert verdict is not None
    return verdict


def sha(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, for a process the test starts on it (etcd, a coordinator
    that must come back on the same port). Taken from this pytest-xdist worker's own block
    below the kernel's ephemeral range (32768 and up): a port the kernel hands out for
    port 0 could be handed to the other worker too before the first binds it (two etcds on
    one port: one test paused its own, failed etcd and talked to the other worker's)."""
    import random
    import socket

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    low = 20000 + 1500 * (worker % 8)
    while True:
        port = random.randrange(low, low + 1500)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def log_events(log: Path) -> list[dict[str, Any]]:
    """The JSON lines of a coordinator's log (anything else in it is skipped)."""
    import json

    events = []
    for line in log.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            events.append(json.loads(line))
    return events


def serving_pid(log: Path, within: float = 10.0) -> int:
    """The pid the coordinator logged when it started serving (the line may follow the port
    file by a moment on a busy machine: waited for, `within` seconds)."""
    give_up = time.monotonic() + within
    while True:
        for event in log_events(log):
            if event.get("event") == "serving":
                return int(event["pid"])
        assert time.monotonic() < give_up, "no 'serving' line in the coordinator log"
        time.sleep(0.05)


def examples(n: int) -> int:
    """A property test's example count; `make mutation` runs each mutant's tests with a
    tenth of them (COHORTGATE_EXAMPLES_SCALE=0.1), at least 20."""
    return max(20, int(n * float(os.environ.get("COHORTGATE_EXAMPLES_SCALE", "1"))))


def decide_in(
    store: CohortStore, cohort: LiveCohort, now: float, options: FormationOptions | None = None
) -> Decision | None:
    """What the service does after a change, for store-level tests: judge the cohort, keep
    the result in the store (None when the store says it was settled meanwhile)."""
    decision, verdict = judge(cohort.state, now, options or FormationOptions())
    return decision if store.apply(cohort, decision, verdict, now) else None


def save_figures(path: Path, figures: object, said: str = "") -> int:
    """A benchmark's summary line printed (`said`), its figures written as JSON at `path`
    (its folder made); 0, the bench's exit code."""
    if said:
        print(said)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1))
    return 0


def python_c(code: str, timeout: float = 60) -> str:
    """What `python -c code` prints, stripped, in a fresh interpreter (fails on an error)."""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=timeout
    )
    return out.stdout.strip()


def member_of(rank: int, manifest: Manifest, **overrides: Any) -> Member:
    """A rank's join as the store holds it (a fresh incarnation; rank 0 offers the
    rendezvous), for tests and benches that drive the service or the store directly."""
    return Member(**{**_rank_fields(rank, manifest), **overrides})


# -- audits during training -----------------------------------------------------------------
AUDITED_TENSORS = ("fc.weight", "fc.bias")


def rank_audit(
    v: pb.Verdict, rank: int, step: int, odd: bool = False, **kw: object
) -> pb.RankAudit:
    """Rank `rank`'s audit of step `step` of the cohort `v` formed, as the agent sends it
    (host{rank // 4}); `odd` gives it another digest than its replicas'."""
    fields: dict[str, object] = {
        "cohort_id": v.cohort_id,
        "job_id": v.job_id,
        "round": v.round,
        "rank": rank,
        "world_size": v.world_size,
        "host": f"host{rank // 4}",
        "incarnation": f"i{rank}",
        "step": step,
        "digest": sha(f"{step}{odd}".encode()),
        "digest_format": DIGEST_FORMAT_VERSION,
    }
    return pb.RankAudit(**{**fields, **kw})  # type: ignore[arg-type]


def tensors_of(v: pb.Verdict, rank: int, step: int, odd: str = "") -> pb.RankAudit:
    """Its per-tensor digests of `step`, as a rank asked for them sends them (`odd`: the
    tensor that differs)."""
    a = rank_audit(v, rank, step, digest=b"")
    a.tensor_names.extend(AUDITED_TENSORS)
    a.tensor_digests.extend(sha(f"{n}{n == odd}".encode()) for n in AUDITED_TENSORS)
    return a


def metric_total(metrics_url: str, name: str) -> float:
    """The sum of a metric's samples at a coordinator's /metrics: `name` alone, or with a
    label selector (`name{level="warn"}`)."""
    import urllib.request

    text = urllib.request.urlopen(f"{metrics_url}/metrics", timeout=5).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith((name + " ", name + "{"))]
    return sum(float(ln.split()[-1]) for ln in lines)


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return str(reply.read().decode())


def hold_partial_cohort(
    coord: InProcessCoordinator, job: str, ranks: list[int], world: int
) -> ThreadPoolExecutor:
    """Ranks that join and wait (the cohort stays incomplete until the test completes it)."""
    m = manifest_of()
    pool = ThreadPoolExecutor(max_workers=len(ranks))
    for r in ranks:
        pool.submit(run_rank, coord.addr, join_request(job, r, world, m), m, 60.0)
    give_up = time.monotonic() + 10
    while True:
        status = json.loads(http_get(coord.metrics_url + "/status.json"))
        waiting = [c for c in status["waiting"] if c["job_id"] == job]
        if waiting and waiting[0]["joined"] == len(ranks):
            return pool
        assert time.monotonic() < give_up, status
        time.sleep(0.05)


def finish_cohort(coord: InProcessCoordinator, job: str, ranks: list[int], world: int) -> None:
    m = manifest_of()
    with ThreadPoolExecutor(max_workers=len(ranks)) as pool:
        list(pool.map(lambda r: run_rank(coord.addr, join_request(job, r, world, m), m), ranks))
