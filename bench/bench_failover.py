"""Failover time of active/standby replicas on etcd: a job waits on the leader with half
its ranks joined; the leader is killed (SIGKILL: its lease must expire; SIGTERM: it hands
the lead over); the other half joins. Measured per run, from the kill:

- to the standby leading (its CohortService SERVING, polled every 10 ms),
- to the first verdict a rank holds (the agent's real join client, COHORTGATE_ADDR=a,b).

Each run starts a fresh replica in place of the one killed (a new standby). Real etcd
(Debian's, started here on free loopback ports), real coordinators, real agent clients.

Usage: python bench/bench_failover.py [--ttl 2,5] [--runs 5] [--ranks 8] [--signal KILL,TERM]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["PATH"] = f"{REPO / '.venv' / 'etcd' / 'usr' / 'bin'}:{os.environ['PATH']}"

from tests.etcd import EtcdServer  # noqa: E402
from tests.ha import Replica, wait_leader  # noqa: E402
from tests.helpers import manifest_of, save_figures, serving_pid, wait_joined  # noqa: E402
from tests.launches import agent_rank, coordinator_process  # noqa: E402


def _replica(stack: contextlib.ExitStack, tmp: Path, etcd: str, prefix: str, ttl: int) -> Replica:
    addr, log = stack.enter_context(
        coordinator_process(
            "--etcd", etcd, "--etcd-prefix", prefix, "--leader-ttl", str(ttl), tmp=tmp
        )
    )
    return Replica(addr, log, serving_pid(log))


def one_run(group: list[Replica], job: str, ranks: int, sig: signal.Signals) -> dict[str, float]:
    leader = wait_leader(group)
    standby = next(r for r in group if r is not leader)
    addrs = f"{leader.addr},{standby.addr}"
    m = manifest_of()
    first_verdict: list[float] = []
    lock = threading.Lock()

    def rank(r: int) -> None:
        agent_rank(addrs, job, r, ranks, m, timeout_s=120)
        with lock:
            first_verdict.append(time.monotonic())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads[: ranks // 2]:
        t.start()
    wait_joined(leader.addr, job, ranks // 2, within=60)
    killed = time.monotonic()
    leader.signal(sig)
    for t in threads[ranks // 2 :]:
        t.start()
    while not standby.leading:
        time.sleep(0.01)
    led = time.monotonic()
    for t in threads:
        t.join(120)
    assert len(first_verdict) == ranks, "a rank got no verdict"
    group.remove(leader)
    return {"to_standby_leading_s": led - killed, "to_first_verdict_s": min(first_verdict) - killed}


def measure(ttl: int, sig: signal.Signals, runs: int, ranks: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp_dir, contextlib.ExitStack() as stack:
        tmp = Path(tmp_dir)
        etcd = EtcdServer(tmp / "etcd").start()
        stack.callback(etcd.stop)
        prefix = f"/bench-failover-{os.getpid()}/"
        group = [_replica(stack, tmp, etcd.endpoint, prefix, ttl)]
        wait_leader(group)
        results = []
        for i in range(runs):
            group.append(_replica(stack, tmp, etcd.endpoint, prefix, ttl))
            results.append(one_run(group, f"failover-{ttl}-{sig.name}-{i}", ranks, sig))
    row: dict[str, Any] = {"ttl_s": ttl, "signal": sig.name, "ranks": ranks, "runs": results}
    for key in ("to_standby_leading_s", "to_first_verdict_s"):
        values = [r[key] for r in results]
        row[key] = {"median": statistics.median(values), "max": max(values)}
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttl", default="2,5", help="leader TTLs to measure (seconds)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--signal", default="KILL,TERM", help="how the leader goes")
    parser.add_argument("--json", type=Path, default=Path("bench/results/failover.json"))
    args = parser.parse_args()
    rows = []
    print(f"{'ttl':>4} {'signal':>7} {'kill->standby leads':>22} {'kill->first verdict':>22}")
    for ttl in (int(t) for t in args.ttl.split(",")):
        for name in args.signal.split(","):
            row = measure(ttl, signal.Signals[f"SIG{name}"], args.runs, args.ranks)
            rows.append(row)
            lead, verdict = row["to_standby_leading_s"], row["to_first_verdict_s"]
            print(
                f"{ttl:>3}s {name:>7} {lead['median']:>9.2f}s (max {lead['max']:.2f}s) "
                f"{verdict['median']:>9.2f}s (max {verdict['max']:.2f}s)"
            )
    return save_figures(args.json, rows)


if __name__ == "__main__":
    sys.exit(main())
