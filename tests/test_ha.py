"""Active/standby replicas on a real etcd: one leads, a standby points agents at it, and
failover never splits a cohort's outcome (SIGKILL, SIGSTOP, a killed etcd)."""

from __future__ import annotations

import json
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
from tests.etcd import EtcdServer
from tests.etcd import prefix as etcd_prefix
from tests.ha import metric, replicas, roles, status_json, wait_leader
from tests.helpers import join_request, manifest_of, wait_joined
from tests.launches import agent_rank

M = manifest_of()
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TTL = 2


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
