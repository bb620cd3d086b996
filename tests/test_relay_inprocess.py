"""The relay's paths with the relay in the test process (tests/relays.py), between real
gRPC clients and a real coordinator, and a gRPC hop (tests/grpc_proxy.py) that keeps each
group as the relay sent it: groups and their cuts, verdicts and refusals to every rank, an
upstream's error to its rank, a rank restarted or gone, and relays of relays. The same paths
through relay processes are test_relays.py's; these are where a mutation run sees the
relay's code."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec.groups import members_of
from cohortgate.coordinator.contract.limits import Limits
from tests.helpers import (
    InProcessCoordinator,
    join_request,
    manifest_of,
    one_cohort,
    run_cohort,
    run_rank,
    wait_until,
)
from tests.relays import InProcessRelay, RelayedNode

FORMED = pb.Verdict.OUTCOME_FORMED
REFUSED = pb.Verdict.OUTCOME_REFUSED

pytestmark = pytest.mark.timeout(90)


class Node(RelayedNode):
    """A coordinator, the hop that keeps what the relay sends it, and the node's relay."""

    def __init__(
        self,
        local_ranks: int = 4,
        max_message_bytes: int = Limits.max_message_bytes,
        window_s: float = 2.0,
        poll: bool = False,
    ) -> None:
        super().__init__(
            {"join_deadline": 30, "progress_interval": 0.2},
            local_ranks=local_ranks,
            max_message_bytes=max_message_bytes,
            window_s=window_s,
            poll=poll,
        )

    def calls(self) -> list[list[int]]:
        """The ranks of each group the relay sent upstream, in the order sent."""
        return [sorted(m.rank for m in members_of(g)) for g in self.hop.groups]


@pytest.fixture
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    """A node relay on a JoinGroup stream upstream (the default), or polling where a test
    asks for both (`BOTH`; `--poll`: a JoinPoll call per event, so the hop sees a group
    once per poll)."""
    n = Node(poll=getattr(request, "param", "stream") == "poll")
    try:
        yield n
    finally:
        n.stop()


BOTH = pytest.mark.parametrize("node", ["stream", "poll"], indirect=True)


def test_a_nodes_ranks_go_up_as_groups_of_local_ranks_and_each_hears_the_verdict(
    node: Node,
) -> None:
    """The node's four ranks (--local-ranks 4) go up as one call as soon as all are in;
    ranks past them (a fifth process of the job on the node) go at once, each alone."""
    m = manifest_of()
    with ThreadPoolExecutor(2) as pool:
        node_ranks = pool.submit(run_cohort, node.addr, "groups", dict.fromkeys(range(4), m), 6)
        wait_until("the node's group sent", lambda: node.hop.groups, 20)
        assert node.calls() == [[0, 1, 2, 3]]
        assert node.hop.sent() == ["classes"]
        results = run_cohort(node.addr, "groups", {4: m, 5: m}, world=6) + node_ranks.result()
    verdict = one_cohort(results, FORMED)
    assert verdict.init_method == "tcp://127.0.0.1:29999"
    assert sum(r.manifest_requests for r in results) == 1
    assert sorted(node.calls()) == [[0, 1, 2, 3], [4], [5]]


@BOTH
def test_a_refusal_reaches_every_rank_of_every_group_with_one_report(node: Node) -> None:
    m = manifest_of()
    manifests = {r: manifest_of(dtype="bfloat16") if r == 5 else m for r in range(8)}
    results = run_cohort(node.addr, "refused", manifests)
    verdict = one_cohort(results, REFUSED)
    polled = node.relay.relay.polling
    assert set(node.hop.methods) == {"JoinPoll" if polled else "JoinGroup"}
    assert {r.verdict.refusal.report for r in results if r.verdict} == {verdict.refusal.report}
    assert "1 rank [5]" in verdict.refusal.report and "bfloat16" in verdict.refusal.report


@BOTH
def test_an_upstream_error_reaches_the_rank_whole(node: Node) -> None:
    m = manifest_of()
    result = run_rank(node.addr, join_request("bad", 9, 4, m), m, timeout=10)
    assert result.error is not None and result.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank 9 is outside [0, 4)" in (result.error.details() or "")


def test_a_group_waits_its_window_for_a_rank_that_never_comes_then_goes(node: Node) -> None:
    """Three of the node's four ranks: they go up after the window (2 s) without the
    fourth, which joins later on its own and the job forms."""
    m = manifest_of()
    with ThreadPoolExecutor(4) as pool:
        first = [
            pool.submit(run_rank, node.addr, join_request("late", r, 4, m), m) for r in range(3)
        ]
        wait_until("the three ranks sent", lambda: node.hop.groups, 20)
        last = pool.submit(run_rank, node.addr, join_request("late", 3, 4, m), m)
        one_cohort([*(f.result() for f in first), last.result()], FORMED)
    assert node.calls() == [[0, 1, 2], [3]]


@BOTH
def test_a_rank_that_leaves_its_group_is_dropped_and_can_come_back(node: Node) -> None:
    m = manifest_of()
    channel = grpc.insecure_channel(node.addr)
    gone = pb_grpc.CohortServiceStub(channel).Join(join_request("back", 1, 3, m), timeout=30)
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(run_rank, node.addr, join_request("back", 0, 3, m), m)
        assert next(gone).WhichOneof("event") in ("manifest_request", "progress")
        gone.cancel()  # the relay re-joins rank 0 alone
        time.sleep(0.5)
        rest = [pool.submit(run_rank, node.addr, join_request("back", r, 3, m), m) for r in (1, 2)]
        results = [first.result(), *(f.result() for f in rest)]
    channel.close()
    one_cohort(results, FORMED)


def test_a_group_is_cut_before_it_outgrows_the_message_limit() -> None:
    """Four ranks whose joins are each over a third of the relay's limit: no group of
    more than two goes up, and every rank forms."""
    m = manifest_of()
    config = pb.Fingerprint(fields={f"layer.{i}.width": f'"{i}"' for i in range(400)})
    size = join_request("cut", 0, 4, m, config=config).ByteSize()
    n = Node(max_message_bytes=int(size * 2.5))
    try:
        results = run_cohort(n.addr, "cut", dict.fromkeys(range(4), m), config=config)
        one_cohort(results, FORMED)
        calls = n.calls()
        assert sorted(r for c in calls for r in c) == [0, 1, 2, 3], calls
        assert [len(c) for c in calls] == [2, 2], calls
    finally:
        n.stop()


def test_a_group_for_an_older_upstream_fits_the_limit_as_sent_one_request_per_rank() -> None:
    """An upstream older than rank classes gets each rank's join whole, each with its
    field's tag and length (3 bytes at this size): with a limit one byte short of three
    joins so sent, no group of three goes up, and every group sent fits."""
    m = manifest_of()
    fields: dict[str, Any] = {
        "config": pb.Fingerprint(fields={f"layer.{i}.width": f'"{i}"' for i in range(400)}),
        "init_method": "tcp://127.0.0.1:29999",  # every rank's join of one size
    }
    limit = 3 * max(join_request("cut", r, 4, m, **fields).ByteSize() for r in range(4)) + 8
    n = RelayedNode({"join_deadline": 30}, older=True, local_ranks=4, max_message_bytes=limit)
    try:
        results = run_cohort(n.addr, "cut", dict.fromkeys(range(4), m), **fields)
        one_cohort(results, FORMED)
        sent = [g for g in n.hop.groups if g.members]
        assert sent and all(g.ByteSize() <= limit for g in sent), [g.ByteSize() for g in sent]
        assert max(len(g.members) for g in sent) == 2, [len(g.members) for g in sent]
    finally:
        n.stop()


def test_a_rack_relay_takes_node_relays_groups_as_one_call() -> None:
    """Two node relays of two ranks each under a rack relay of four: the coordinator gets
    one call of four ranks."""
    rack = Node(local_ranks=4)
    nodes = [InProcessRelay(rack.addr, local_ranks=2) for _ in range(2)]
    try:
        m = manifest_of()
        with ThreadPoolExecutor(4) as pool:
            futures = [
                pool.submit(run_rank, nodes[r // 2].addr, join_request("rack", r, 4, m), m)
                for r in range(4)
            ]
            results = [f.result() for f in futures]
        one_cohort(results, FORMED)
        assert rack.calls() == [[0, 1, 2, 3]]
    finally:
        for n in nodes:
            n.stop()
        rack.stop()


def test_a_rank_that_joins_again_sends_its_old_group_at_once_and_starts_the_next() -> None:
    """A restarted process of rank 1 (another pid and incarnation) while the group of its
    old process waits (a window of 30 s here: only a rank joining again sends it): that
    group goes up as it is, at once, and the new process joins the next one; once the old
    call is gone the job forms with the new process."""
    from tests.helpers import joined

    node = Node(window_s=30)
    m = manifest_of()
    channel = grpc.insecure_channel(node.addr)
    old = pb_grpc.CohortServiceStub(channel).Join(
        join_request("again", 1, 4, m, incarnation="old", pid=7), timeout=30
    )
    try:
        # the old process's join is in the relay first (else the new one would be the old)
        wait_until(
            "the old process held",
            lambda: any(1 in g.ranks for g in node.relay.relay._pending.values()),
            10,
        )
        with ThreadPoolExecutor(4) as pool:
            new = pool.submit(run_rank, node.addr, join_request("again", 1, 4, m), m)
            wait_until("the old process's group sent", lambda: node.hop.groups, 10)
            assert node.calls() == [[1]]  # sent at once, well before its window
            old.cancel()
            wait_until(
                "the old process gone", lambda: joined(node.coordinator.addr, "again") == 0, 20
            )
            rest = [
                pool.submit(run_rank, node.addr, join_request("again", r, 4, m), m)
                for r in (0, 2, 3)
            ]
            one_cohort([new.result(), *(f.result() for f in rest)], FORMED)
        assert sorted(r for c in node.calls()[1:] for r in c) == [0, 1, 2, 3], node.calls()
    finally:
        old.cancel()
        channel.close()
        node.stop()


def test_a_relay_speaks_tls_both_ways_and_presents_its_certificate_upstream(pki: Path) -> None:
    """A coordinator that takes only clients with certificates (mutual TLS), a relay that
    presents one upstream and serves its ranks over TLS: the job forms through it."""
    from cohortgate.coordinator.codec.channel import ClientSecurity
    from cohortgate.coordinator.edge.exposure import ServerTLS

    server = {"tls_cert": pki / "server.pem", "tls_key": pki / "server.key"}
    coordinator = InProcessCoordinator(tls_client_ca=pki / "ca.pem", **server)
    client = ClientSecurity(
        tls=True, ca=pki / "ca.pem", cert=pki / "client.pem", key=pki / "client.key"
    )
    relay = InProcessRelay(
        coordinator.addr, client, ServerTLS(server["tls_cert"], server["tls_key"]), local_ranks=2
    )
    try:
        m = manifest_of()
        ranks = ClientSecurity(tls=True, ca=pki / "ca.pem")
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(
                    run_rank, relay.addr, join_request("tls", r, 2, m), m, 30.0, None, ranks
                )
                for r in range(2)
            ]
            one_cohort([f.result() for f in futures], FORMED)
    finally:
        relay.stop()
        coordinator.stop()


def test_the_next_run_of_a_job_batches_afresh_once_a_verdict_went_out(node: Node) -> None:
    """Two runs of one job id through the node relay, one after the other: each goes up as one
    group of the node's four ranks (the first run's ranks sent do not count toward the
    second's group)."""
    m = manifest_of()
    for launch in ("tcp://first:29500", "tcp://second:29500"):
        one_cohort(
            run_cohort(node.addr, "twice", dict.fromkeys(range(4), m), launch=launch), FORMED
        )
    assert node.calls() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    relay = node.relay.relay
    wait_until("the relay keeps no task once its jobs are decided", lambda: not relay._tasks, 10)


def test_ranks_past_the_nodes_local_ranks_go_up_at_once_each() -> None:
    """With a long window (20 s): the node's four ranks go up as they complete the group;
    a fifth and then a sixth process of the job on the node each go up at once, alone."""
    node = Node(window_s=20)
    try:
        m = manifest_of()
        with ThreadPoolExecutor(6) as pool:
            first = pool.submit(run_cohort, node.addr, "past", dict.fromkeys(range(4), m), 6)
            wait_until("the node's group sent", lambda: node.calls() == [[0, 1, 2, 3]], 10)
            fifth = pool.submit(run_rank, node.addr, join_request("past", 4, 6, m), m)
            wait_until("rank 4 sent at once", lambda: len(node.calls()) == 2, 10)
            sixth = pool.submit(run_rank, node.addr, join_request("past", 5, 6, m), m)
            wait_until("rank 5 sent at once", lambda: len(node.calls()) == 3, 10)
            one_cohort([*first.result(), fifth.result(), sixth.result()], FORMED)
        assert node.calls() == [[0, 1, 2, 3], [4], [5]]
    finally:
        node.stop()


def test_a_quiet_rank_hears_its_first_progress_only_and_a_loud_one_each() -> None:
    """Rank 0 prints the job's progress; the other ranks (quiet, as agents join) are told
    once that they wait: the relay passes the coordinator's progress on to each rank that
    way, so a waiting node's quiet ranks get one event, not one every interval."""
    node = Node(window_s=0.2)
    try:
        m = manifest_of()
        with ThreadPoolExecutor(3) as pool:
            first = [
                pool.submit(run_rank, node.addr, join_request("q", r, 3, m, quiet=r > 0), m)
                for r in (0, 1)
            ]
            time.sleep(1.5)  # ~7 progress intervals
            last = pool.submit(run_rank, node.addr, join_request("q", 2, 3, m, quiet=True), m)
            results = [*(f.result() for f in first), last.result()]
        one_cohort(results, FORMED)
        assert len(results[0].progress) >= 4, results[0].progress
        assert len(results[1].progress) == 1, results[1].progress
    finally:
        node.stop()


@pytest.mark.parametrize("poll", [False, True], ids=["stream", "poll"])
def test_ranks_with_different_tokens_never_go_up_in_one_call(tmp_path: Path, poll: bool) -> None:
    """A node's two ranks of one job, one with the job's token and one with a token that is
    no token: each group goes up with its own rank's token, so the second is refused
    (UNAUTHENTICATED) and never counts as a member; the first waits for it in vain."""
    from tests.test_security import TOKEN_A, bearer, join_once

    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A} job-a\n")
    node = RelayedNode({"join_deadline": 2, "tokens_file": tokens}, local_ranks=2, poll=poll)
    try:
        with grpc.insecure_channel(node.addr) as ch, ThreadPoolExecutor(2) as pool:
            sent = [(0, bearer(TOKEN_A)), (1, bearer("no-such-token-0123456789"))]
            futures = [pool.submit(join_once, ch, "job-a", md, 2, rank) for rank, md in sent]
            with pytest.raises(grpc.RpcError) as refused:
                futures[1].result()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            verdict = futures[0].result()
        assert verdict.outcome == REFUSED
        assert verdict.refusal.cause == pb.Refusal.CAUSE_DEADLINE
        assert verdict.refusal.missing_ranks == "1", verdict
    finally:
        node.stop()


def test_a_relay_refuses_a_long_poll_from_below_and_says_what_it_takes(node: Node) -> None:
    with grpc.insecure_channel(node.addr) as ch, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.CohortServiceStub(ch).JoinPoll(pb.JoinGroupRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert caught.value.details() == (
        "a relay takes JoinGroup from the relays below it, not JoinPoll"
    )


def test_a_rank_that_leaves_a_group_not_yet_sent_leaves_the_rest_waiting_for_the_node(
    node: Node,
) -> None:
    """Ranks 0 and 1 wait in the node's group (2 of its 4 ranks), then rank 1's process
    dies: nothing goes up for rank 0 alone; its restart and the node's other ranks join
    the same group, which goes up once, whole."""
    m = manifest_of()
    pending = node.relay.relay._pending

    def waiting() -> set[int]:
        return {r for group in pending.values() for r in group.ranks}

    with grpc.insecure_channel(node.addr) as channel, ThreadPoolExecutor(4) as pool:
        first = pool.submit(run_rank, node.addr, join_request("unsent", 0, 4, m), m)
        wait_until("rank 0 waits in the group", lambda: waiting() == {0}, 10)
        gone = pb_grpc.CohortServiceStub(channel).Join(join_request("unsent", 1, 4, m))
        wait_until("rank 1 waits in the group", lambda: waiting() == {0, 1}, 10)
        gone.cancel()
        wait_until("rank 1 left the group", lambda: waiting() == {0}, 10)
        assert node.hop.groups == [], "rank 0 went up alone"
        rest = [
            pool.submit(run_rank, node.addr, join_request("unsent", r, 4, m), m) for r in (1, 2, 3)
        ]
        one_cohort([first.result(), *(f.result() for f in rest)], FORMED)
    assert node.calls() == [[0, 1, 2, 3]]


def test_a_polling_relay_under_an_upstream_without_joinpoll_joins_on_a_stream() -> None:
    """`relay --poll` under a rack relay (which takes JoinGroup only, as a coordinator
    before 0.3 did): its first poll is refused UNIMPLEMENTED, and it joins on a stream
    from then on; its ranks form, never told of the refusal."""
    coordinator = InProcessCoordinator(join_deadline=30)
    rack = InProcessRelay(coordinator.addr, local_ranks=2)
    node = InProcessRelay(rack.addr, local_ranks=2, poll=True)
    try:
        m = manifest_of()
        for job in ("a", "b"):
            one_cohort(run_cohort(node.addr, job, {0: m, 1: m}), FORMED)
        assert node.relay.polling is False
    finally:
        node.stop()
        rack.stop()
        coordinator.stop()
