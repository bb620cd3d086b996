"""Replicas on a real etcd, in the test process (test_ha.py runs them as the processes users
start; here a mutation run sees the replica's code): a standby names the leader to every
join and audit, with readiness and the leader metric to match; the standby takes over when
the leader stops; a replica that cannot reach etcd says that no replica leads, and leads
once etcd is back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec.leader import LEADER_KEY
from tests.etcd import EtcdServer, etcd_server
from tests.etcd import prefix as etcd_prefix
from tests.ha import health
from tests.helpers import (
    InProcessCoordinator,
    join_request,
    manifest_of,
    metric_total,
    one_cohort,
    rank_audit,
    run_cohort,
    wait_until,
)

pytestmark = pytest.mark.timeout(90)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
TTL = 2


def replica(endpoint: str, key_prefix: str) -> InProcessCoordinator:
    return InProcessCoordinator(etcd=endpoint, etcd_prefix=key_prefix, leader_ttl=TTL)


def leading(group: list[InProcessCoordinator]) -> list[InProcessCoordinator]:
    return [c for c in group if health(c.addr) == SERVING]


def refused_join(addr: str, timeout: float = 5.0) -> grpc.RpcError:
    """A join's error: a standby's refusal, or from a leader (which holds it) its deadline."""
    with grpc.insecure_channel(addr) as channel, pytest.raises(grpc.RpcError) as refused:
        list(
            pb_grpc.CohortServiceStub(channel).Join(
                join_request("j", 0, 2, manifest_of()), timeout=timeout
            )
        )
    return refused.value


def refuses(addr: str) -> bool:
    """Whether a join is refused as by a standby now."""
    return bool(refused_join(addr, timeout=0.5).code() == grpc.StatusCode.UNAVAILABLE)


@pytest.fixture
def pair(etcd: EtcdServer) -> Iterator[tuple[InProcessCoordinator, InProcessCoordinator]]:
    """Two replicas on one key prefix, (the leader, the standby)."""
    key_prefix = etcd_prefix()
    group = [replica(etcd.endpoint, key_prefix), replica(etcd.endpoint, key_prefix)]
    try:
        wait_until("one replica leads", lambda: len(leading(group)) == 1, 30)
        (leader,) = leading(group)
        standby = next(c for c in group if c is not leader)
        # the standby reads who leads from etcd a moment after the leader won: until then
        # it says a failover is under way (the test below asserts the words once it knows)
        wait_until(
            "the standby knows the leader",
            lambda: (
                dict(refused_join(standby.addr).trailing_metadata() or ()).get(LEADER_KEY)
                == leader.addr
            ),
            10,
        )
        yield leader, standby
    finally:
        for c in group:
            c.stop()


def test_a_standby_names_the_leader_to_joins_and_audits_and_the_leader_forms_jobs(
    pair: tuple[InProcessCoordinator, InProcessCoordinator],
) -> None:
    leader, standby = pair
    assert (health(standby.addr, ""), health(standby.addr)) == (
        SERVING,
        NOT_SERVING,
    )  # alive, not ready
    refused = refused_join(standby.addr)
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.details() == (
        f"this coordinator is a standby; the leader is at {leader.addr} (the agent follows "
        "it; give agents every replica in COHORTGATE_ADDR=a:7070,b:7070)"
    )
    assert dict(refused.trailing_metadata() or ())[LEADER_KEY] == leader.addr
    m = manifest_of()
    formed = one_cohort(run_cohort(leader.addr, "led", {0: m, 1: m}), pb.Verdict.OUTCOME_FORMED)
    audit = rank_audit(formed, 0, 1)
    with grpc.insecure_channel(standby.addr) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.CohortServiceStub(channel).Audit(pb.AuditRequest(audits=[audit]), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(caught.value.trailing_metadata() or ())[LEADER_KEY] == leader.addr
    assert metric_total(leader.metrics_url, "cohortgate_leader") == 1.0
    assert metric_total(standby.metrics_url, "cohortgate_leader") == 0.0
    assert metric_total(leader.metrics_url, "cohortgate_leader_takeovers_total") == 1.0


def test_the_standby_leads_once_the_leader_stops_and_forms_the_next_job(
    pair: tuple[InProcessCoordinator, InProcessCoordinator],
) -> None:
    leader, standby = pair
    leader.stop()  # steps down (resigns its lease) as it stops
    wait_until("the standby leads", lambda: health(standby.addr) == SERVING, TTL + 3)
    m = manifest_of()
    one_cohort(run_cohort(standby.addr, "next", {0: m, 1: m}), pb.Verdict.OUTCOME_FORMED)
    assert metric_total(standby.metrics_url, "cohortgate_leader") == 1.0
    assert metric_total(standby.metrics_url, "cohortgate_leader_takeovers_total") == 1.0


def test_a_replica_without_etcd_says_no_replica_leads_and_leads_once_etcd_is_back(
    tmp_path: Path,
) -> None:
    with etcd_server(tmp_path) as etcd:
        etcd.kill()
        c = replica(etcd.endpoint, etcd_prefix())
        try:
            refused = refused_join(c.addr)
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            details = refused.details() or ""
            assert details.startswith("this coordinator is a standby and no replica leads now ("), (
                details
            )
            assert details.endswith("); retry"), details
            assert LEADER_KEY not in dict(refused.trailing_metadata() or ())
            etcd.start()
            wait_until("it leads", lambda: health(c.addr) == SERVING, 30)
            m = manifest_of()
            one_cohort(run_cohort(c.addr, "back", {0: m, 1: m}), pb.Verdict.OUTCOME_FORMED)
        finally:
            c.stop()


def test_a_leader_that_cannot_renew_its_lease_stops_admitting_by_its_own_clock(
    tmp_path: Path,
) -> None:
    """etcd hung (SIGSTOP): the leader's renewals go unanswered, and once its lease may have
    expired by its own clock it refuses joins before any etcd call fails (another replica may
    lead by then); with etcd back its lease is renewed and it admits again."""
    with etcd_server(tmp_path) as etcd:
        c = replica(etcd.endpoint, etcd_prefix())
        try:
            wait_until("it leads", lambda: health(c.addr) == SERVING, 30)
            etcd.pause()
            try:
                wait_until("it refuses joins", lambda: refuses(c.addr), TTL + 3)
                refused = refused_join(c.addr)
            finally:
                etcd.resume()
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
            assert "no replica leads now" in (refused.details() or ""), refused.details()
            # etcd's lease clock stopped with it: the next renewal holds, no step-down
            wait_until("it admits again", lambda: not refuses(c.addr), 30)
        finally:
            c.stop()


def test_a_relay_given_the_standby_first_follows_it_to_the_leader_and_its_ranks_form(
    pair: tuple[InProcessCoordinator, InProcessCoordinator],
) -> None:
    """`relay --upstream standby,leader`: the standby's refusal names the leader, the relay
    moves its upstream there at once (no rank hears the refusal, nor of an outage) and the
    node's ranks form; its later calls go to the leader first."""
    from tests.relays import InProcessRelay

    leader, standby = pair
    relay = InProcessRelay(f"{standby.addr},{leader.addr}", local_ranks=2)
    try:
        m = manifest_of()
        results = run_cohort(relay.addr, "follow", {0: m, 1: m})
        one_cohort(results, pb.Verdict.OUTCOME_FORMED)
        assert relay.relay.upstream == leader.addr
        said = [p.message for r in results for p in r.progress]
        assert not [s for s in said if "lost the coordinator" in s], "a standby is no outage"
        one_cohort(run_cohort(relay.addr, "again", {0: m, 1: m}), pb.Verdict.OUTCOME_FORMED)
    finally:
        relay.stop()


def test_a_relay_given_a_standby_sends_its_audits_on_to_the_leader_it_names(
    pair: tuple[InProcessCoordinator, InProcessCoordinator],
) -> None:
    """A node relay given one replica's address, the standby's (a name that resolved to it),
    that has joined nobody yet audits a job formed on the leader: its first call reaches
    the standby, whose refusal names the leader; the relay moves there and the ranks'
    audits are answered, no rank told of the standby."""
    from tests.relays import InProcessRelay, audit_step

    leader, standby = pair
    m = manifest_of()
    formed = one_cohort(run_cohort(leader.addr, "audited", {0: m, 1: m}), pb.Verdict.OUTCOME_FORMED)
    relay = InProcessRelay(standby.addr, local_ranks=2, audit_window_s=0.2)
    try:
        replies = audit_step(lambda _: relay.addr, {r: rank_audit(formed, r, 1) for r in (0, 1)})
        for rank, reply in replies.items():
            assert isinstance(reply, pb.AuditReply), (rank, reply)
            assert [a.cohort_id for a in reply.answers] == [formed.cohort_id]
        assert relay.relay.upstream == leader.addr
    finally:
        relay.stop()
