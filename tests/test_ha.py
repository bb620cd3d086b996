"""Active/standby replicas on a real etcd: one leads, a standby points agents at it, and
failover never splits a cohort's outcome (SIGKILL, SIGSTOP, a killed etcd)."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec.leader import LEADER_KEY, Upstream
from cohortgate.coordinator.decision.verdict import Outcome
from cohortgate.coordinator.etcd import etcd_pb2 as epb
from cohortgate.coordinator.etcd.client import EtcdError, EtcdSettings, EtcdThread, prefix_end
from cohortgate.coordinator.etcd.leader import Leadership
from cohortgate.coordinator.state.base import VerdictRow
from cohortgate.coordinator.state.etcd_history import EtcdHistory
from tests.etcd import EtcdServer, etcd_server
from tests.etcd import prefix as etcd_prefix
from tests.ha import metric, replicas, roles, stamp, status_json, wait_leader
from tests.helpers import (
    TRAIN,
    agent_rank,
    finish,
    free_port,
    join_request,
    kill_group,
    launch,
    launch_env,
    manifest_of,
    two_node_args,
    wait_joined,
)
from tests.netfault import FaultProxy
from tests.test_store_contract import verdict_of

M = manifest_of()
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TTL = 2


def held_job(
    tmp: Path, addrs: str, job: str, hold: Path, *, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], list[str]]:
    """A 4-rank torchrun job whose ranks 2 and 3 join once `hold` exists."""
    args = [
        "--nproc-per-node",
        "4",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "0",
        "--monitor-interval",
        "0.2",
        str(TRAIN),
        "--steps",
        "1",
        "--hold-rank",
        "2",
        "--hold-rank",
        "3",
        "--hold-file",
        str(hold),
    ]
    environment = launch_env(
        tmp, COHORTGATE_ADDR=addrs, COHORTGATE_JOB=job, MASTER_ADDR="127.0.0.1", **(env or {})
    )
    return launch(args, environment, tmp), args


def formed_ids(out: str) -> set[str]:
    return set(re.findall(r"cohort (\S+) formed, all_reduce sum 10", out))


# -- leadership and the store, without coordinators --------------------------------------
@pytest.mark.timeout(60)
def test_one_of_two_campaigners_leads_and_the_other_takes_over_when_it_resigns(
    etcd: EtcdServer,
) -> None:
    settings = EtcdSettings(etcd.endpoint, prefix=etcd_prefix())
    threads = [EtcdThread(settings), EtcdThread(settings)]
    changes: list[tuple[str, bool]] = []
    both = [
        Leadership(
            t,
            replica=name,
            advertise=f"{name}:7070",
            ttl_s=TTL,
            changed=functools.partial(lambda n, leading, _: changes.append((n, leading)), name),
        )
        for t, name in zip(threads, ("a", "b"), strict=True)
    ]
    try:
        both[0].start()
        give_up = time.monotonic() + 10
        while not both[0].leading:
            assert time.monotonic() < give_up
            time.sleep(0.02)
        both[1].start()
        time.sleep(1.5)
        assert not both[1].leading and both[1].lead.advertise == "a:7070", "b sees who leads"
        both[0].close()  # revokes its lease: b leads at once, not after the TTL
        resigned = time.monotonic()
        while not both[1].leading:
            assert time.monotonic() - resigned < 2.0, "b did not take over after a resigned"
            time.sleep(0.02)
        assert changes == [("a", True), ("a", False), ("b", True)]
    finally:
        for leadership in both:
            leadership.close()
        for t in threads:
            t.close()


@pytest.mark.timeout(60)
def test_a_hung_etcd_fails_every_call_in_flight_as_an_etcd_error(tmp_path: Path) -> None:
    """A call that times out drops its channel; the calls still on it (a lease renewal in
    flight) fail as EtcdError too, never as a cancellation that would end the loop that
    made them (a leader that never campaigned again after a hung etcd came back)."""
    with etcd_server(tmp_path) as etcd:
        thread = EtcdThread(EtcdSettings(etcd.endpoint, timeout_s=1.0))
        client = thread.client
        try:
            thread.run(client.range(b"warm"), 5)
            etcd.pause()

            async def both() -> list[object]:
                request = epb.RangeRequest(key=b"slow")
                slow = client.call(
                    "slow range", lambda md, _: client.kv.Range(request, timeout=10, metadata=md)
                )
                got: list[object] = await asyncio.gather(
                    slow, client.range(b"fast"), return_exceptions=True
                )
                return got

            outcomes = thread.run(both(), 15)
            assert [type(o) for o in outcomes] == [EtcdError, EtcdError], outcomes
            assert "its channel broke" in str(outcomes[0])
            etcd.resume()
            thread.run(client.range(b"again"), 5)  # and the next call finds etcd again
        finally:
            etcd.resume()  # (a running etcd takes SIGCONT as nothing)
            thread.close()


@pytest.mark.timeout(60)
def test_a_replica_that_no_longer_leads_stores_no_verdict_and_steps_down(
    etcd: EtcdServer,
) -> None:
    """The fence: a write under a token whose leader key was replaced (another replica
    leads now) is not stored, `written` is never called, and `lost` is."""
    settings = EtcdSettings(etcd.endpoint, prefix=etcd_prefix())
    thread = EtcdThread(settings)
    key = settings.key_prefix + b"leader"

    async def take() -> int:
        await thread.client.put(key, b"{}")
        return int((await thread.client.range(key)).kvs[0].create_revision)

    try:
        old = thread.run(take(), timeout=5)
        lost: list[str] = []
        store = EtcdHistory(thread, token=lambda: old, lost=lost.append)
        thread.run(thread.client.delete(key), timeout=5)
        thread.run(take(), timeout=5)  # the key again, created by someone else
        written = threading.Event()
        store.record(VerdictRow.of(verdict_of("j", 1), {0: "a"}), written.set)
        assert store.flush(5)
        assert not written.is_set(), "a verdict written without the lead"
        assert lost and "no longer this replica" in lost[0]
        stored = thread.run(
            thread.client.range(
                settings.key_prefix + b"v/", prefix_end(settings.key_prefix + b"v/")
            ),
            timeout=5,
        )
        assert not stored.kvs, "nothing stored"
        assert store.get("j") is None and store.last_round("j") == 0
    finally:
        thread.close()


@pytest.mark.timeout(60)
def test_a_record_larger_than_one_etcd_request_is_stored_in_parts_and_read_back(
    etcd: EtcdServer,
) -> None:
    settings = EtcdSettings(etcd.endpoint, prefix=etcd_prefix())
    thread = EtcdThread(settings)
    key = settings.key_prefix + b"leader"
    try:

        async def take() -> int:
            await thread.client.put(key, b"{}")
            return int((await thread.client.range(key)).kvs[0].create_revision)

        token = thread.run(take(), timeout=5)
        store = EtcdHistory(thread, token=lambda: token)
        import os

        members = {r: os.urandom(48).hex() for r in range(30_000)}  # ~2.9 MB, ~1.5 MB packed
        written = threading.Event()
        verdict = verdict_of("big", 1)
        store.record(VerdictRow.of(verdict, members), written.set)
        assert written.wait(10), store.problem
        again = EtcdHistory(thread)  # a standby: reads the listing, the parts on demand
        row = again.get("big")
        assert row is not None and row.members == members
        assert again.verdict_of("big", members[29_999]) == verdict
    finally:
        thread.close()


# -- replicas as processes ---------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_standby_answers_joins_with_the_leaders_address_which_the_agent_follows(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    with replicas(tmp_path, etcd.endpoint, etcd_prefix(), ttl=TTL) as (first, second):
        leader = wait_leader([first, second])
        standby = second if leader is first else first
        assert standby.health("") == SERVING, "liveness: a standby is not to be restarted"
        assert standby.health() == NOT_SERVING, "readiness: no Service sends agents here"
        with grpc.insecure_channel(standby.addr) as channel:
            stub = pb_grpc.CohortServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Join(join_request("j", 0, 1, M), timeout=5))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"the leader is at {leader.addr}" in (refused.value.details() or "")
        named = dict(refused.value.trailing_metadata() or ())
        assert named[LEADER_KEY] == leader.addr
        # the agent's real client, given the standby only, follows it to the leader
        verdicts: list[pb.Verdict | None] = [None, None]

        def rank(r: int) -> None:
            verdicts[r] = agent_rank(standby.addr, "followed", r, 2, M, timeout_s=30)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert all(v is not None and v.outcome == pb.Verdict.OUTCOME_FORMED for v in verdicts)
        assert leader.events("cohort formed") and not standby.events("cohort formed")
        assert metric(leader, "cohortgate_leader") == 1.0
        assert metric(standby, "cohortgate_leader") == 0.0
        assert metric(leader, "cohortgate_leader_takeovers_total") == 1.0
        # audits during training: a standby takes none, and names the leader as for joins
        formed = verdicts[0]
        assert formed is not None
        audit = pb.RankAudit(
            cohort_id=formed.cohort_id,
            job_id="followed",
            round=formed.round,
            rank=0,
            world_size=2,
            step=1,
            digest=b"\x01" * 32,
            digest_format=2,
        )
        with (
            grpc.insecure_channel(standby.addr) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            pb_grpc.CohortServiceStub(channel).Audit(pb.AuditRequest(audits=[audit]), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert dict(refused.value.trailing_metadata() or ())[LEADER_KEY] == leader.addr
        with grpc.insecure_channel(leader.addr) as channel:
            reply = pb_grpc.CohortServiceStub(channel).Audit(pb.AuditRequest(audits=[audit]))
        assert reply.answers[0].cohort_id == formed.cohort_id
        # a standby's status says so and lists the leader's verdicts (shared history)
        status = status_json(standby)
        assert status["replica"]["role"] == "standby"
        assert "the leader is at" in status["degraded"]["standby"]
        deadline = time.monotonic() + 5
        while not any(v["job_id"] == "followed" for v in status["recent_verdicts"]):
            assert time.monotonic() < deadline, "the standby never saw the leader's verdict"
            time.sleep(0.2)
            status = status_json(standby)


@pytest.mark.timeout(120)
def test_explain_and_status_read_whichever_replica_answers_and_etcd_itself(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    prefix = etcd_prefix()
    with replicas(tmp_path, etcd.endpoint, prefix, ttl=TTL) as group:
        leader, standby = roles(group)
        job = "explained"
        verdicts: list[pb.Verdict | None] = [None, None]

        def rank(r: int) -> None:
            wide = manifest_of(8) if r == 1 else M  # refused: a report to explain
            verdicts[r] = agent_rank(leader.addr, job, r, 2, wide, timeout_s=30)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
        assert all(v is not None and v.outcome == pb.Verdict.OUTCOME_REFUSED for v in verdicts)
        cli = [sys.executable, "-m", "cohortgate.coordinator.cli"]

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)

        give_up = time.monotonic() + 10
        while (asked := run("explain", job, "--addr", standby.addr, "--json")).returncode:
            assert time.monotonic() < give_up, asked.stderr  # the standby catches up each 1 s
            time.sleep(0.3)
        from_etcd = run("explain", job, "--etcd", etcd.endpoint, "--etcd-prefix", prefix, "--json")
        assert from_etcd.returncode == 0, from_etcd.stderr
        first = verdicts[0]
        assert first is not None
        for out in (asked.stdout, from_etcd.stdout):
            record = json.loads(out)
            assert record["cohort_id"] == first.cohort_id
            assert record["outcome"] == "refused" and "signature" in record["report"]
        listed = run("status", "--addr", f"{standby.addr},{leader.addr}", "--json")
        assert listed.returncode == 0, listed.stderr
        assert job in listed.stdout, "the leader was asked (a standby holds no cohorts)"
        missing = run("explain", "nope", "--etcd", etcd.endpoint, "--etcd-prefix", prefix)
        assert missing.returncode == 1 and "no verdict of job 'nope' in etcd" in missing.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_leader_stopped_with_sigterm_hands_over_at_once_and_no_rank_is_lost(
    tmp_path: Path, etcd: EtcdServer
) -> None:
    """SIGTERM (a rolling update): the leader revokes its lease before its gRPC grace, so a
    standby leads well within the TTL (10 s here); ranks that join while it stops (their
    calls cancelled by grpc) retry and form there."""
    with replicas(tmp_path, etcd.endpoint, etcd_prefix(), 2, 10, "--grace", "30") as group:
        leader, standby = roles(group)
        addrs = f"{leader.addr},{standby.addr}"
        verdicts: dict[int, object] = {}
        # a call that stays open through the grace (a health watch): the lead must not wait
        watching = grpc.insecure_channel(leader.addr)
        watch = health_pb2_grpc.HealthStub(watching).Watch(health_pb2.HealthCheckRequest())
        next(watch)

        def rank(r: int) -> None:
            try:  # bounded well inside the test's timeout: a failure shows each rank's end
                verdicts[r] = agent_rank(addrs, "rolled", r, 8, M, timeout_s=45)
            except Exception as exc:
                verdicts[r] = exc

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)]
        for t in threads[:4]:
            t.start()
        wait_joined(leader.addr, "rolled", 4)
        leader.signal(signal.SIGTERM)
        stopped = time.monotonic()
        for t in threads[4:]:
            t.start()
        while not standby.leading:
            assert time.monotonic() - stopped < 5, "the lead waited for the lease to expire"
            time.sleep(0.02)
        for t in threads:
            t.join(60)
        outcomes = {r: getattr(v, "outcome", v) for r, v in verdicts.items()}
        logs = "\n".join(f"{r.addr}:\n{r.log.read_text()[-6000:]}" for r in group)
        assert outcomes == dict.fromkeys(range(8), pb.Verdict.OUTCOME_FORMED), (outcomes, logs)
        watching.close()


@pytest.mark.timeout(120)
def test_a_replica_started_while_etcd_is_away_stands_by_then_leads_once_it_is_back(
    tmp_path: Path,
) -> None:
    etcd = EtcdServer(tmp_path / "late-etcd")  # its ports chosen, not started yet
    try:
        with replicas(tmp_path, etcd.endpoint, etcd_prefix(), 1, TTL, wait=False) as (only,):
            assert only.health("") == SERVING and only.health() == NOT_SERVING
            with (
                grpc.insecure_channel(only.addr) as channel,
                pytest.raises(grpc.RpcError) as refused,
            ):
                list(pb_grpc.CohortServiceStub(channel).Join(join_request("j", 0, 1, M)))
            assert "no replica leads now" in (refused.value.details() or "")
            assert f"127.0.0.1:{etcd.client_port}" in (refused.value.details() or "")
            etcd.start()
            wait_leader([only], within=20)
            verdict = agent_rank(only.addr, "late", 0, 1, M, timeout_s=30)
            assert verdict.outcome == pb.Verdict.OUTCOME_FORMED
    finally:
        etcd.stop()


@pytest.mark.timeout(120)
def test_replicas_reach_etcd_over_tls_with_a_user_and_a_wrong_password_is_named(
    tmp_path: Path, pki: Path
) -> None:
    """etcd serving TLS only, authentication on (user root): a replica with the CA and the
    user's password file leads and forms a job; one with a wrong password stands by, its
    joins told that etcd refused it."""
    etcd = EtcdServer(tmp_path / "tls-etcd", pki=pki).start()
    try:
        etcd.etcdctl("user", "add", "root", "--new-user-password", "s3cret")
        etcd.etcdctl("auth", "enable")
        (tmp_path / "pw").write_text("s3cret\n")
        (tmp_path / "bad").write_text("wrong\n")
        auth = ["--etcd-ca", str(pki / "ca.pem"), "--etcd-user", "root"]
        prefix = etcd_prefix()
        good = [*auth, "--etcd-password-file", str(tmp_path / "pw")]
        with replicas(tmp_path, etcd.endpoint, prefix, 1, TTL, *good) as (leader,):
            verdict = agent_rank(leader.addr, "over-tls", 0, 1, M, timeout_s=30)
            assert verdict.outcome == pb.Verdict.OUTCOME_FORMED
            bad = [*auth, "--etcd-password-file", str(tmp_path / "bad")]
            with replicas(tmp_path, etcd.endpoint, prefix, 1, TTL, *bad, wait=False) as (no,):
                time.sleep(1.0)
                assert no.health() == NOT_SERVING
                with grpc.insecure_channel(no.addr) as channel, pytest.raises(grpc.RpcError) as e:
                    list(pb_grpc.CohortServiceStub(channel).Join(join_request("j", 0, 1, M)))
                said = e.value.details() or ""
                assert "authentication failed" in said and "etcd at 127.0.0.1" in said, said
    finally:
        etcd.stop()


def test_upstream_rotates_through_its_replicas_and_follows_a_named_leader() -> None:
    class Refusal:
        def __init__(self, leader: str = "", details: str = "") -> None:
            self._md = ((LEADER_KEY, leader),) if leader else ()
            self._details = details

        def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
            return self._md

        def details(self) -> str:
            return self._details

    up = Upstream("a:1,b:2,c:3")
    assert up.current == "a:1"
    assert up.failed(Refusal()) == 0.0 and up.current == "b:2", "next replica, at once"
    assert up.failed(Refusal(leader="c:3")) == 0.0 and up.current == "c:3", "the named leader"
    assert up.failed(Refusal()) is None and up.current == "a:1", "all tried: back off"
    assert up.failed(Refusal()) == 0.0 and up.current == "b:2", "a new turn"
    up.reached()
    standby = Refusal(details="this coordinator is a standby and no replica leads now")
    pauses = [up.failed(standby) for _ in range(3)]
    assert pauses[:2] == [0.0, 0.0] and 0.25 <= (pauses[2] or 0) <= 0.5, "asked again in 0.5 s"
    single = Upstream("svc:7070")
    assert 0.25 <= (single.failed(standby) or 0) <= 0.5 and single.failed(Refusal()) is None
    with pytest.raises(Exception, match="COHORTGATE_ADDR"):
        Upstream("a:1,nonsense")


def test_rank_0_says_no_replica_leads_while_a_standby_answers_whatever_the_other_says(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After a kill the dead leader's address refuses connections while the standby answers
    that it stands by: rank 0 says no replica leads (the standby's words), not that
    nothing listens."""
    from cohortgate.agent.client import JoinOptions
    from cohortgate.agent.reachability import Reachability
    from cohortgate.agent.torchrun import RankIdentity

    identity = RankIdentity(
        job_id="j", rank=0, world_size=2, local_rank=0, host="h", pid=1, incarnation="i",
        restart_count=0, addr="a:1,b:2", error_file=None, endpoint_host="127.0.0.1",
    )  # fmt: skip
    reach = Reachability(identity, time.monotonic() + 60, JoinOptions(unreachable_after_s=0))
    caplog.set_level("INFO", logger="cohortgate.agent")  # where rank 0 says it (a handler)
    reach.failed("this coordinator is a standby; the leader is at a:1")
    caplog.clear()
    reach.said_at = None  # say again now
    reach.failed("failed to connect to all addresses; last error: Connection refused")
    said = caplog.text
    assert "no cohortgate coordinator at a:1,b:2 leads now: this coordinator is a standby" in said
    assert "(and: connection refused (nothing listens there))" in said
    assert "cannot reach" not in said
    reach.reached()
    reach.failed("failed to connect to all addresses; last error: Connection refused")
    caplog.clear()
    reach.said_at = None
    reach.failed("failed to connect to all addresses; last error: Connection refused")
    assert "cannot reach the cohortgate coordinator at a:1,b:2" in caplog.text


def test_a_standby_logs_its_refusals_once_per_job_and_interval() -> None:
    from cohortgate.coordinator.edge.servicer import QuietRefusals

    now = [0.0]
    quiet = QuietRefusals(lambda: now[0])
    said = [quiet.due("a") for _ in range(54)]  # 4 ranks asking every ~0.4 s for 5 s
    assert said[0] == 1 and said[1:] == [None] * 53
    assert quiet.due("b") == 1, "each job has its line"
    now[0] += QuietRefusals.EVERY_S
    assert quiet.due("a") == 54, "the next line counts the refusals it stands for"


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
