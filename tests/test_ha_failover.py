"""Failover under a running job, on a real etcd: the leader killed while a job waits (direct
and through node relays), killed during the fan-out, paused past a takeover, and etcd itself
killed: every rank ends with one verdict, and none is sent unstored."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2

from cohortgate.coordinator.decision.verdict import Outcome
from cohortgate.coordinator.etcd.client import EtcdSettings, EtcdThread, prefix_end
from cohortgate.coordinator.state.etcd_history import EtcdHistory
from tests.etcd import EtcdServer, etcd_server
from tests.etcd import prefix as etcd_prefix
from tests.ha import formed_ids, held_job, metric, replicas, roles, stamp, wait_leader
from tests.helpers import free_port, wait_joined
from tests.launches import TRAIN, finish, kill_group, launch, launch_env, two_node_args
from tests.netfault import FaultProxy

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TTL = 2


# -- failover, end to end --------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_leader_killed_while_a_job_waits_the_job_forms_on_the_standby(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    hold = tmp_path / "go"
    with replicas(tmp_path, etcd.endpoint, etcd_prefix(), ttl=TTL) as group:
        leader, standby = roles(group)
        proc, _ = held_job(tmp_path, f"{leader.addr},{standby.addr}", "killed-leader", hold)
        try:
            wait_joined(leader.addr, "killed-leader", 2, within=90)
            leader.signal(signal.SIGKILL)
            killed = time.time()
            hold.touch()
            (out,) = finish([proc], timeout=180)
        finally:
            kill_group(proc)
        assert proc.returncode == 0, out
        assert len(formed_ids(out)) == 1 and out.count("trained 1 steps") == 4, out
        formed = standby.events("cohort formed")
        assert formed, "the standby formed it"
        took = stamp(formed[0]) - killed
        assert took < TTL + 3, f"formed {took:.1f}s after the kill (TTL {TTL}s)"
        # Quiet while it stood by: a line per job and 30 s, not one per refused join.
        assert len(standby.events("standing by: joins refused")) <= 2
        assert not [e for e in standby.events("rpc refused") if e["code"] == "UNAVAILABLE"]
        assert "cannot reach the cohortgate coordinator" not in out, out


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_through_node_relays_a_killed_leaders_job_forms_on_the_standby(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """`cohortgate run --coordinator a,b` on two nodes: each node's relay follows the lead;
    node 0's group waits on the leader, which is killed before node 1's ranks join."""
    hold = tmp_path / "go"
    with replicas(tmp_path, etcd.endpoint, etcd_prefix(), ttl=TTL) as group:
        leader, standby = roles(group)
        rdzv = f"127.0.0.1:{free_port()}"
        script = ["--steps", "1", "--hold-rank", "2", "--hold-rank", "3"]
        args = [
            "--coordinator",
            f"{standby.addr},{leader.addr}",  # the standby first: the relays follow it
            *two_node_args(rdzv, "relayed", TRAIN, *script, "--hold-file", str(hold)),
        ]
        procs = [launch(args, launch_env(tmp_path), tmp_path, via="cohortgate run") for _ in "ab"]
        try:
            wait_joined(leader.addr, "relayed", 2, within=90)
            leader.signal(signal.SIGKILL)
            killed = time.time()
            hold.touch()
            outs = finish(procs, timeout=180)
        finally:
            for p in procs:
                kill_group(p)
        for p, out in zip(procs, outs, strict=True):
            assert p.returncode == 0, out
            assert "through this node's relay" in out, out
        assert len(formed_ids(outs[0]) | formed_ids(outs[1])) == 1, outs
        assert sum(out.count("trained 1 steps") for out in outs) == 4, outs
        formed = standby.events("cohort formed")
        assert formed and stamp(formed[0]) - killed < TTL + 3, formed


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_leader_killed_during_the_fan_out_every_rank_ends_with_the_same_verdict(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """Two nodes. Node 1's ranks (2-3) reach the leader through a proxy, which holds what
    flows once they have joined; node 0's ranks then join directly and the cohort forms:
    the verdict is stored, and reaches ranks 0-1 only. The leader is killed the moment etcd
    holds the verdict, and what the proxy held for ranks 2-3 is dropped (reset). They
    re-join the standby and get the stored verdict: one cohort, trained by all four."""
    prefix, hold = etcd_prefix(), tmp_path / "go"
    settings = EtcdSettings(etcd.endpoint, prefix=prefix)
    watcher = EtcdThread(settings)
    try:
        with replicas(tmp_path, etcd.endpoint, prefix, ttl=TTL) as group:
            leader, standby = roles(group)
            with FaultProxy(leader.addr) as proxy:
                rdzv = f"127.0.0.1:{free_port()}"
                node_args = two_node_args(
                    rdzv,
                    "fan-out",
                    TRAIN,
                    "--steps",
                    "1",
                    "--hold-rank",
                    "0",
                    "--hold-rank",
                    "1",
                    "--hold-file",
                    str(hold),
                )
                procs = [
                    launch(
                        node_args,
                        launch_env(tmp_path, COHORTGATE_ADDR=f"{via},{standby.addr}"),
                        tmp_path,
                    )
                    for via in (leader.addr, proxy.addr)
                ]
                try:
                    wait_joined(leader.addr, "fan-out", 2, within=90)
                    proxy.delay(60.0)  # ranks 2-3 hear nothing more from the leader
                    hold.touch()
                    key = settings.key_prefix + b"v/fan-out/"
                    give_up = time.monotonic() + 60
                    while not watcher.run(watcher.client.range(key, prefix_end(key)), 5).kvs:
                        assert time.monotonic() < give_up, "no verdict stored"
                        time.sleep(0.002)
                    leader.signal(signal.SIGKILL)
                    proxy.reset()
                    outs = finish(procs, timeout=180)
                finally:
                    for p in procs:
                        kill_group(p)
        for p, out in zip(procs, outs, strict=True):
            assert p.returncode == 0, out
        ids = formed_ids(outs[0]) | formed_ids(outs[1])
        assert len(ids) == 1, outs
        assert sum(out.count("trained 1 steps") for out in outs) == 4, outs
        assert standby.events("verdict replayed from history"), "ranks 2-3 got it replayed"
        assert not standby.events("cohort formed"), "no second cohort"
    finally:
        watcher.close()


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_paused_leader_that_wakes_after_a_takeover_sends_nothing_and_steps_down(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    hold = tmp_path / "go"
    with replicas(tmp_path, etcd.endpoint, etcd_prefix(), ttl=TTL) as group:
        old, standby = roles(group)
        proc, _ = held_job(tmp_path, f"{old.addr},{standby.addr}", "paused-leader", hold)
        try:
            wait_joined(old.addr, "paused-leader", 2, within=90)
            old.signal(signal.SIGSTOP)
            try:
                give_up = time.monotonic() + TTL + 10
                while not standby.leading:
                    assert time.monotonic() < give_up, "the standby never took over"
                    time.sleep(0.05)
                hold.touch()  # ranks 2-3 now try the paused one first, then the new leader
                time.sleep(1.0)
            finally:
                old.signal(signal.SIGCONT)
            (out,) = finish([proc], timeout=200)
        finally:
            kill_group(proc)
        assert proc.returncode == 0, out
        assert len(formed_ids(out)) == 1 and out.count("trained 1 steps") == 4, out
        assert standby.events("cohort formed")
        assert not old.events("cohort formed"), "the old leader decided nothing"
        assert old.events("stepped down")
        assert old.health() == NOT_SERVING and old.health("") == SERVING


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_with_etcd_killed_no_verdict_is_sent_unstored_and_launches_resume_once_it_is_back(
    tmp_path: Path, fault: str
) -> None:
    """etcd SIGKILLed (then started again), or hung (SIGSTOP, then SIGCONT: its calls time
    out instead of failing at once, longer than a verdict would wait for SQLite). The job
    completes while etcd is away: no rank hears a verdict until etcd is back, and the one
    they all hear is the one etcd holds."""
    hold = tmp_path / "go"
    with etcd_server(tmp_path) as etcd:
        prefix = etcd_prefix()
        with replicas(tmp_path, etcd.endpoint, prefix, ttl=TTL) as group:
            leader = wait_leader(group)
            addrs = ",".join(r.addr for r in group)
            proc, _ = held_job(tmp_path, addrs, "etcd-down", hold)
            try:
                wait_joined(leader.addr, "etcd-down", 2, within=90)
                etcd.kill() if fault == "kill" else etcd.pause()
                hold.touch()  # the cohort completes while etcd is away
                time.sleep(TTL + 4)  # (rank 0 says why it waits after 3 s of it)
                assert not any(r.leading for r in group), "a leader without etcd"
                decided = [e for r in group for e in r.events("cohort formed")]
                # Decided (the cohort is complete) but not stored: no rank may have it yet.
                # (With a 1 s fallback to sending unstored, the job has trained and ended.)
                assert proc.poll() is None, "a rank got a verdict while etcd was away"
                etcd.start() if fault == "kill" else etcd.resume()
                (out,) = finish([proc], timeout=200)
            finally:
                kill_group(proc)
            assert proc.returncode == 0, out
            assert "no cohortgate coordinator at" in out and "leads now" in out, out
            assert f"127.0.0.1:{etcd.client_port}" in out, "rank 0 names etcd as the cause"
            (cohort_id,) = formed_ids(out)
            thread = EtcdThread(EtcdSettings(etcd.endpoint, prefix=prefix))
            try:
                stored = EtcdHistory(thread, readonly=True).get("etcd-down")
            finally:
                thread.close()
            assert stored is not None and stored.cohort_id == cohort_id, "the verdict is stored"
            assert stored.outcome == Outcome.FORMED.value
            # What was decided while etcd was away either reached etcd when it came back (a
            # hung etcd commits the write it held) and was replayed, or was decided again.
            assert decided, "the cohort completed while etcd was away"
            assert metric(leader, 'cohortgate_etcd_errors_total{operation="leadership"}') > 0
            lost = sum(
                metric(leader, f'cohortgate_leader_step_downs_total{{why="{why}"}}')
                for why in ("lease", "fence")
            )
            assert lost >= 1, "the leader stepped down while etcd was away"
