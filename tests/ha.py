"""Replicas of `cohortgate serve --etcd` as real processes, for the failover tests."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.helpers import log_events, serving_pid
from tests.launches import TRAIN, coordinator_process, freeze, launch, launch_env, one_node_args

SERVICE = "cohortgate.v1.CohortService"


def health(addr: str, service: str = SERVICE) -> int:
    """The gRPC health status of `service` at `addr` (-1: no answer)."""
    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
        except grpc.RpcError:
            return -1
        return int(reply.status)


@dataclass
class Replica:
    addr: str
    log: Path
    pid: int

    def health(self, service: str = SERVICE) -> int:
        """The gRPC health status of `service` (-1: no answer)."""
        return health(self.addr, service)

    @property
    def leading(self) -> bool:
        return bool(self.health() == health_pb2.HealthCheckResponse.SERVING)

    def signal(self, sig: signal.Signals) -> None:
        if sig == signal.SIGSTOP:
            freeze(self.pid)  # returns once it is stopped, not merely signalled
        else:
            os.kill(self.pid, sig)

    def events(self, name: str) -> list[dict[str, object]]:
        return [e for e in log_events(self.log) if e.get("event") == name]


@contextlib.contextmanager
def replicas(
    tmp: Path,
    endpoint: str,
    prefix: str,
    n: int = 2,
    ttl: int = 2,
    *flags: str,
    wait: bool = True,
) -> Iterator[list[Replica]]:
    """`n` replicas on one etcd (the first started leads: the others start once it does;
    `wait=False`: nobody waits for a leader)."""
    with contextlib.ExitStack() as stack:
        started: list[Replica] = []
        for _ in range(n):
            addr, log = stack.enter_context(
                coordinator_process(
                    "--etcd",
                    endpoint,
                    "--etcd-prefix",
                    prefix,
                    "--leader-ttl",
                    str(ttl),
                    "--progress-interval",
                    "0.2",
                    *flags,
                    tmp=tmp,
                )
            )
            started.append(Replica(addr, log, serving_pid(log)))
            if len(started) == 1 and wait:
                wait_leader(started)
        yield started


def wait_leader(group: list[Replica], within: float = 30.0) -> Replica:
    """The one replica that leads, once exactly one does."""
    give_up = time.monotonic() + within
    while True:
        leading = [r for r in group if r.leading]
        if len(leading) == 1:
            return leading[0]
        assert time.monotonic() < give_up, f"no single leader: {len(leading)} lead"
        time.sleep(0.05)


def roles(group: list[Replica]) -> tuple[Replica, Replica]:
    """(the leader, a standby) of a group of replicas, once one leads."""
    leader = wait_leader(group)
    return leader, next(r for r in group if r is not leader)


def stamp(event: dict[str, object]) -> float:
    """A log line's time, in seconds since the epoch."""
    from datetime import datetime

    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def _http(replica: Replica, path: str) -> bytes:
    """GET `path` from a replica's HTTP port (named in its 'serving' log line)."""
    import urllib.request

    (serving,) = replica.events("serving")
    with urllib.request.urlopen(f"http://{serving['metrics']}{path}", timeout=5) as reply:
        return bytes(reply.read())


def status_json(replica: Replica) -> dict[str, Any]:
    return dict(json.loads(_http(replica, "/status.json")))


def metric(replica: Replica, series: str) -> float:
    """The value of one series in a replica's /metrics (0 when it has no sample)."""
    for line in _http(replica, "/metrics").decode().splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def held_job(
    tmp: Path, addrs: str, job: str, hold: Path, *, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], list[str]]:
    """A 4-rank torchrun job whose ranks 2 and 3 join once `hold` exists."""
    args = one_node_args(
        TRAIN,
        "--steps",
        "1",
        "--hold-rank",
        "2",
        "--hold-rank",
        "3",
        "--hold-file",
        str(hold),
    )
    environment = launch_env(
        tmp, COHORTGATE_ADDR=addrs, COHORTGATE_JOB=job, MASTER_ADDR="127.0.0.1", **(env or {})
    )
    return launch(args, environment, tmp), args


def formed_ids(out: str) -> set[str]:
    return set(re.findall(r"cohort (\S+) formed, all_reduce sum 10", out))
