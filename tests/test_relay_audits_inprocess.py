"""A relay's audits (edge/relay_audits.py) with the relay in the test process, between real
gRPC clients and a real coordinator, through a hop that keeps each Audit call as the relay
sent it: a node's ranks' audits go up as one call a step (at once when every local rank's is
in, after the window when one never comes), each rank answered for its own cohort; one
rank's bad audit is its error only; an upstream that is down is every rank's error, sent
once; per-tensor digests go alone; a batch is cut before the coordinator's limit. The same
paths through relay processes are test_relays.py's; these are where a mutation run sees the
relay's code."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.contract.limits import MAX_AUDITS_PER_CALL
from tests.helpers import (
    manifest_of,
    one_cohort,
    rank_audit,
    run_cohort,
    tensors_of,
    wait_until,
)
from tests.relays import RelayedNode, audit_step

pytestmark = pytest.mark.timeout(90)


class Node(RelayedNode):
    """A coordinator, the hop that keeps each Audit call, and a node relay of 4 local ranks;
    a job of 4 ranks formed through it (`v`)."""

    def __init__(self, local_ranks: int = 4, audit_window_s: float = 0.5) -> None:
        super().__init__(
            {"join_deadline": 30, "audit_timeout": 30},
            local_ranks=local_ranks,
            audit_window_s=audit_window_s,
        )
        m = manifest_of()
        results = run_cohort(self.addr, "audits", dict.fromkeys(range(4), m))
        self.v = one_cohort(results, pb.Verdict.OUTCOME_FORMED)

    def step(self, audits: dict[int, pb.RankAudit]) -> dict[int, pb.AuditReply | grpc.RpcError]:
        return audit_step(lambda _: self.addr, audits)

    def calls(self) -> list[list[tuple[int, int]]]:
        """The (rank, step) of each audit of each call the relay sent up, in order."""
        return [[(a.rank, a.step) for a in req.audits] for req in self.hop.audits]


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    try:
        yield n
    finally:
        n.stop()


def answered(replies: dict[int, pb.AuditReply | grpc.RpcError], v: pb.Verdict) -> list[int]:
    """The ranks answered for their cohort, one answer each."""
    ok = []
    for rank, reply in replies.items():
        assert isinstance(reply, pb.AuditReply), (rank, reply)
        assert [a.cohort_id for a in reply.answers] == [v.cohort_id], (rank, reply)
        ok.append(rank)
    return sorted(ok)


def test_a_nodes_audits_go_up_as_one_call_a_step_and_a_bad_one_is_its_ranks_error_only(
    node: Node,
) -> None:
    v = node.v
    for step in range(2):
        assert answered(node.step({r: rank_audit(v, r, step) for r in range(4)}), v) == [0, 1, 2, 3]
    assert [sorted(c) for c in node.calls()] == [[(r, s) for r in range(4)] for s in range(2)]
    wait_until("no batch kept once sent", lambda: not node.relay.relay.audits._tasks, 10)

    # step 2: rank 3's weights changed; rank 1 sends a digest of 5 bytes, which spoils the
    # batch at the coordinator: each rank's request goes again alone
    step2 = {r: rank_audit(v, r, 2, odd=r == 3) for r in range(4)}
    replies = node.step({**step2, 1: rank_audit(v, 1, 2, digest=b"short")})
    bad = replies.pop(1)
    assert isinstance(bad, grpc.RpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "digest" in (bad.details() or ""), bad.details()
    assert answered(replies, v) == [0, 2, 3]
    assert sorted(len(c) for c in node.calls()[2:]) == [1, 1, 1, 1, 4]

    # rank 1's good audit completes step 2: ranks 0 and 3 are asked for their tensors,
    # which go up alone (a few MB each), and the divergence is named
    (late,) = node.step({1: step2[1]}).values()
    assert isinstance(late, pb.AuditReply)
    asked = sorted(zip(late.answers[0].tensors_rank, late.answers[0].tensors_step, strict=True))
    assert asked == [(0, 2), (3, 2)]
    before = len(node.calls())
    told = node.step({0: tensors_of(v, 0, 2), 3: tensors_of(v, 3, 2, odd="fc.bias")})
    assert sorted(node.calls()[before:]) == [[(0, 2)], [(3, 2)]]
    headline = "replicas diverged at step 2: rank 3 on host0 differs from ranks 0-2 in fc.bias"
    heard = [r.answers[0].headline for r in told.values() if isinstance(r, pb.AuditReply)]
    assert headline in heard, told


def test_a_nodes_batch_goes_up_once_every_local_ranks_audit_is_in_not_at_the_window() -> None:
    """A window past the calls' 30 s deadline: only the fourth rank's audit sends the batch."""
    node = Node(audit_window_s=120.0)
    try:
        v = node.v
        assert answered(node.step({r: rank_audit(v, r, 0) for r in range(4)}), v) == [0, 1, 2, 3]
        assert len(node.calls()) == 1
    finally:
        node.stop()


def test_a_rank_that_never_audits_holds_its_node_only_for_the_window() -> None:
    node = Node(audit_window_s=0.5)
    try:
        v = node.v
        assert answered(node.step({r: rank_audit(v, r, 0) for r in range(3)}), v) == [0, 1, 2]
        assert [sorted(c) for c in node.calls()] == [[(0, 0), (1, 0), (2, 0)]]
    finally:
        node.stop()


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_bad_audit_in_a_batch_of_one_or_two_ranks_is_its_ranks_error_only(ranks: int) -> None:
    """Rank 0's audit has a digest of 5 bytes: alone in its batch, its call is not sent
    again; beside rank 1's, each goes again alone and rank 1 is answered."""
    node = Node(audit_window_s=0.5)
    try:
        v = node.v
        audits = {r: rank_audit(v, r, 0) for r in range(ranks)}
        replies = node.step({**audits, 0: rank_audit(v, 0, 0, digest=b"short")})
        bad = replies.pop(0)
        assert isinstance(bad, grpc.RpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert answered(replies, v) == list(range(1, ranks))
        assert sorted(len(c) for c in node.calls()) == ([1] if ranks == 1 else [1, 1, 2])
    finally:
        node.stop()


def test_an_upstream_that_is_down_is_every_ranks_error_sent_once(node: Node) -> None:
    node.coordinator.stop()
    replies = node.step({r: rank_audit(node.v, r, 0) for r in range(4)})
    for rank, reply in replies.items():
        assert isinstance(reply, grpc.RpcError), (rank, reply)
        assert reply.code() == grpc.StatusCode.UNAVAILABLE, (rank, reply.details())
    assert len(node.calls()) == 1, "an error that is no one request's is not sent again alone"


def test_requests_the_coordinator_refuses_whole_go_up_alone_and_its_words_come_back(
    node: Node,
) -> None:
    """Audits of two jobs in one request, and a request of none: sent up as they came (the
    coordinator says what is wrong with each), not batched."""
    a, b = rank_audit(node.v, 0, 0), rank_audit(node.v, 1, 0, job_id="another")
    for audits, said in (([a, b], "not a cohort of job 'another'"), ([], "holds no audits")):
        with grpc.insecure_channel(node.addr) as ch, pytest.raises(grpc.RpcError) as caught:
            pb_grpc.CohortServiceStub(ch).Audit(pb.AuditRequest(audits=audits), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert said in (caught.value.details() or ""), caught.value.details()
    assert node.calls() == [[(0, 0), (1, 0)], []]


@pytest.mark.parametrize(("steps", "calls"), [(150, [600, 600]), (128, [1024])])
def test_a_batch_is_cut_before_it_passes_the_coordinators_limit_on_audits_per_call(
    steps: int, calls: list[int]
) -> None:
    """A rack relay: two requests of 600 audits each (ranks that queued many steps while the
    coordinator was away) would make one call of 1,200, past the limit: the first goes up
    as soon as the second would pass it, and both are answered. Two of 512 make one call of
    1,024, the limit itself."""
    node = Node(local_ranks=4096, audit_window_s=2.0)
    try:
        v = node.v
        requests = [
            pb.AuditRequest(
                audits=[rank_audit(v, r, s) for s in range(first, first + steps) for r in range(4)]
            )
            for first in (0, steps)
        ]
        assert MAX_AUDITS_PER_CALL == 1024
        with grpc.insecure_channel(node.addr) as ch, ThreadPoolExecutor(2) as pool:
            stub = pb_grpc.CohortServiceStub(ch)
            first = pool.submit(stub.Audit, requests[0], timeout=30)
            time.sleep(0.3)  # the first is held for the rack's other ranks
            second = pool.submit(stub.Audit, requests[1], timeout=30)
            replies = [first.result(), second.result()]
        assert [[a.cohort_id for a in r.answers] for r in replies] == [[v.cohort_id]] * 2
        assert [len(c) for c in node.calls()] == calls
    finally:
        node.stop()


def test_each_ranks_token_goes_up_with_its_audits_and_two_jobs_never_share_a_call(
    tmp_path: Path,
) -> None:
    """Job-scoped tokens: two one-rank jobs audit through one relay at once, each with its
    own token: each batch goes up with its own job's token (one call with the other's would
    be refused for the other job), as does a request sent up alone (per-tensor digests)."""
    from tests.test_security import TOKEN_A, TOKEN_B, bearer, join_once

    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A} job-a\n{TOKEN_B} job-b\n")
    node = RelayedNode({"join_deadline": 30, "tokens_file": tokens}, local_ranks=4)
    try:
        with grpc.insecure_channel(node.addr) as ch:
            v = {
                t: join_once(ch, job, bearer(t))
                for t, job in ((TOKEN_A, "job-a"), (TOKEN_B, "job-b"))
            }
            stub = pb_grpc.CohortServiceStub(ch)
            with ThreadPoolExecutor(2) as pool:
                replies = list(
                    pool.map(
                        lambda t: stub.Audit(
                            pb.AuditRequest(audits=[rank_audit(v[t], 0, 1)]),
                            timeout=10,
                            metadata=bearer(t),
                        ),
                        v,
                    )
                )
            assert [[a.cohort_id for a in r.answers] for r in replies] == [
                [v[TOKEN_A].cohort_id],
                [v[TOKEN_B].cohort_id],
            ]
            assert sorted(len(r.audits) for r in node.hop.audits) == [1, 1], "one call a job"
            alone = stub.Audit(
                pb.AuditRequest(audits=[tensors_of(v[TOKEN_A], 0, 1)]),
                timeout=10,
                metadata=bearer(TOKEN_A),
            )
            assert [a.cohort_id for a in alone.answers] == [v[TOKEN_A].cohort_id]
            # a bad audit beside a good one: each goes again alone, with its token
            with ThreadPoolExecutor(2) as pool:
                good, bad = pool.map(
                    lambda audit: _reply_or_error(stub, audit, bearer(TOKEN_A)),
                    [rank_audit(v[TOKEN_A], 0, 2), rank_audit(v[TOKEN_A], 0, 3, digest=b"short")],
                )
            assert isinstance(good, pb.AuditReply), good
            assert isinstance(bad, grpc.RpcError), bad
            assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.details()
            # a call with a token that is no token is never sent up with another's
            tokens_sent = [bearer(TOKEN_A), bearer("no-such-token-0123456789")]
            with ThreadPoolExecutor(2) as pool:
                good, bad = pool.map(
                    lambda md: _reply_or_error(stub, rank_audit(v[TOKEN_A], 0, 4), md), tokens_sent
                )
            assert isinstance(good, pb.AuditReply), good
            assert isinstance(bad, grpc.RpcError), bad
            assert bad.code() == grpc.StatusCode.UNAUTHENTICATED, bad.details()
    finally:
        node.stop()


def _reply_or_error(
    stub: pb_grpc.CohortServiceStub, audit: pb.RankAudit, metadata: list[tuple[str, str]]
) -> pb.AuditReply | grpc.RpcError:
    try:
        reply: pb.AuditReply = stub.Audit(
            pb.AuditRequest(audits=[audit]), timeout=10, metadata=metadata
        )
        return reply
    except grpc.RpcError as exc:
        return exc
