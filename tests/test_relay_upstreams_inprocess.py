"""A relay and what lies above it, with the relays in the test process (where a mutation run
sees their code): an upstream older than rank classes (a coordinator, or a rack relay) gets
one request per rank after its first answer; a coordinator that goes away holds the node's
ranks until one answers again; a lower relay's malformed group is refused with what is
wrong. test_relay_classes.py and test_relay_faults.py run the same through relay
processes."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec.groups import as_classes
from tests.grpc_proxy import SERVICE, GrpcProxy
from tests.helpers import (
    InProcessCoordinator,
    join_request,
    manifest_of,
    one_cohort,
    run_async,
    run_cohort,
    run_rank,
    wait_until,
)
from tests.relays import InProcessRelay, RelayedNode

FORMED = pb.Verdict.OUTCOME_FORMED

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("older", ["coordinator", "rack relay"])
def test_an_older_upstream_gets_one_request_per_rank_after_its_first_empty_answer(
    older: str,
) -> None:
    """The hop drops the rank classes on the way up, as an older upstream's parser does: an
    older coordinator answers "the group has no members", an older rack relay "got 0
    members". From then on the node relay sends that upstream one request per rank: both
    jobs form, the first re-joined at once."""
    coordinator = InProcessCoordinator(join_deadline=30)
    rack = InProcessRelay(coordinator.addr, local_ranks=4) if older == "rack relay" else None
    hop = GrpcProxy(rack.addr if rack else coordinator.addr, older=True)
    node = InProcessRelay(hop.addr, local_ranks=4, window_s=20)
    try:
        m = manifest_of()
        for job in ("a", "b"):
            one_cohort(run_cohort(node.addr, job, dict.fromkeys(range(4), m)), FORMED)
        assert hop.sent() == ["classes", "members", "members"]
    finally:
        node.stop()
        hop.stop()
        if rack is not None:
            rack.stop()
        coordinator.stop()


def test_an_upstream_that_reads_one_request_per_rank_as_empty_too_is_an_error_not_a_loop() -> None:
    """The fall back to one request per rank is taken once a group: where the upstream
    reads that as empty too, the ranks get its error; the relay does not re-join on and on."""
    node = RelayedNode({"join_deadline": 30}, older="empty", local_ranks=1)
    try:
        m = manifest_of()
        result = run_rank(node.addr, join_request("empty", 0, 1, m), m, timeout=10)
        assert result.error is not None
        assert result.error.code() == grpc.StatusCode.INVALID_ARGUMENT, result.error
        assert "the group has no members" in (result.error.details() or "")
        assert node.hop.sent() == ["classes", "members"]
    finally:
        node.stop()


def test_a_current_upstream_that_refuses_a_group_for_another_reason_is_not_taken_as_older() -> None:
    node = RelayedNode({"join_deadline": 30}, local_ranks=1)
    try:
        m = manifest_of()
        for _ in range(2):
            result = run_rank(node.addr, join_request("bad", 9, 4, m), m, timeout=10)
            assert result.error is not None
            assert result.error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert node.hop.sent() == ["classes", "classes"], "still sent as classes"
    finally:
        node.stop()


def test_ranks_held_while_the_coordinator_is_gone_form_on_the_one_that_answers_next() -> None:
    """The coordinator goes away (its hop then answers UNAVAILABLE): the relay holds the
    node's ranks through five refused tries, no rank hears an error, and once a coordinator
    answers again (another process behind the same address) they join it and form."""
    node = RelayedNode({"join_deadline": 30}, local_ranks=2, window_s=0.2)
    node.coordinator.stop()
    second = InProcessCoordinator(join_deadline=30)
    try:
        m = manifest_of()
        with ThreadPoolExecutor(2) as pool:
            futures = [
                pool.submit(run_rank, node.addr, join_request("held", r, 2, m), m, 60.0)
                for r in range(2)
            ]
            # five tries refused (0.2 + 0.5 + 1 + 1 s apart): an outage of some seconds
            wait_until("the group refused upstream 5 times", lambda: len(node.hop.groups) >= 5, 20)
            assert not any(f.done() for f in futures), "a rank heard the outage"
            node.hop.reroute(second.addr)
            results = [f.result() for f in futures]
        one_cohort(results, FORMED)
        outage = [p for p in results[0].progress if "lost the coordinator" in p.message]
        assert outage, "rank 0 (loud) is told why it waits"
        assert (outage[0].job_id, outage[0].round, outage[0].expected) == ("held", 0, 2)
        told = [p.message for p in outage]
        assert told[0].startswith(f"the relay lost the coordinator at {node.hop.addr} (") and told[
            0
        ].endswith(
            "); it holds this node's ranks and re-joins them once it answers (unreachable for 0s)"
        ), told[0]
        assert "(no details)" not in told[0], "the upstream's error, in its words"
    finally:
        node.stop()
        second.stop()


def _refused(addr: str, group: pb.JoinGroupRequest) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(addr) as ch, pytest.raises(grpc.RpcError) as caught:
        next(pb_grpc.CohortServiceStub(ch).JoinGroup(group, timeout=10))
    return caught.value.code(), caught.value.details() or ""


def test_a_lower_relays_malformed_group_is_refused_with_what_is_wrong() -> None:
    node = RelayedNode({"join_deadline": 30}, local_ranks=4)
    try:
        m = manifest_of()
        two_jobs = pb.JoinGroupRequest(
            members=[join_request("a", 0, 2, m), join_request("b", 1, 2, m)]
        )
        assert _refused(node.addr, two_jobs) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "a group joins distinct ranks of one job, world size and round; got 2 members "
            "of 2 jobs",
        )
        twice = pb.JoinGroupRequest(members=[join_request("a", 0, 2, m)] * 2)
        assert _refused(node.addr, twice)[0] == grpc.StatusCode.INVALID_ARGUMENT
        ragged = as_classes([join_request("a", r, 2, m) for r in range(2)])
        ragged.ranks[-1].pid.append(7)  # one value more than the class has ranks
        assert _refused(node.addr, ragged) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            "a class of the group holds columns of different lengths: one value per rank",
        )
        assert node.hop.groups == [], "nothing malformed went up"
    finally:
        node.stop()


def test_a_request_for_one_ranks_digests_reaches_that_rank_only() -> None:
    """Weights that differ under weights=strict: the coordinator asks one rank of each
    weights class for its per-tensor digests, on the node's one call; the relay hands each
    request to the rank it names, not to the node's every rank."""
    node = RelayedNode(
        {"join_deadline": 30, "policy": "weights=strict", "manifest_timeout": 2}, local_ranks=2
    )
    try:
        m = manifest_of()
        joins = [
            join_request(
                "digests", r, 2, m, weights_digest=bytes([r + 1]) * 32, weights_digest_format=2
            )
            for r in range(2)
        ]
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda j: run_rank(node.addr, j, m), joins))
        one_cohort(results, pb.Verdict.OUTCOME_REFUSED)
        assert {r.rank: r.digest_requests for r in results} == {0: [0], 1: [1]}
    finally:
        node.stop()


def test_an_upstream_that_ends_the_groups_stream_without_a_verdict_tells_its_ranks() -> None:
    """The node's one call upstream ends cleanly (status OK) after its first answer, with no
    verdict: its ranks are told at once (UNAVAILABLE, the agent's cue to re-join), never
    left waiting for a verdict that will not come; the next run of the job forms."""
    node = RelayedNode({"join_deadline": 30}, local_ranks=2)
    node.hop.to_cut = 1
    try:
        m = manifest_of()
        cut = run_cohort(node.addr, "cut", dict.fromkeys(range(2), m), timeout=20)
        for r in cut:
            assert r.error is not None and r.error.code() == grpc.StatusCode.UNAVAILABLE, r.error
            assert r.error.details() == (
                f"the coordinator at {node.hop.addr} ended the group without a verdict"
            )
            assert r.verdict is None
        one_cohort(run_cohort(node.addr, "cut", dict.fromkeys(range(2), m)), FORMED)
    finally:
        node.stop()


def test_a_relay_takes_the_rank_grace_its_upstream_says_or_none_where_it_cannot_say() -> None:
    """What a relay started without --rank-grace asks its upstream (the Settings call): a
    coordinator's `serve --rank-grace`, a rack relay's own grace; None (the relay keeps its
    default) where the upstream says none, or does not answer within the time given (a
    port that accepts and never speaks; a server that takes the call and never answers)."""
    coordinator = InProcessCoordinator(join_deadline=30, rank_grace=2.5)
    rack = InProcessRelay(coordinator.addr, rank_grace_s=3.5)
    silent = socket.create_server(("127.0.0.1", 0))
    stuck = threading.Event()
    hung, hung_port = _never_answering_server(stuck)
    relays = {
        "coordinator": InProcessRelay(coordinator.addr),
        "rack": InProcessRelay(rack.addr),
        "silent": InProcessRelay(f"127.0.0.1:{silent.getsockname()[1]}"),
        "hung": InProcessRelay(f"127.0.0.1:{hung_port}"),
    }
    try:
        said = {k: run_async(r.relay.upstream_grace(1.0), timeout=10) for k, r in relays.items()}
        assert said == {"coordinator": 2.5, "rack": 3.5, "silent": None, "hung": None}
        rack.relay.rank_grace_s = 0.0  # says none
        assert run_async(relays["rack"].relay.upstream_grace(1.0), timeout=10) is None
        rack.relay.rank_grace_s = 1.0
        assert run_async(relays["rack"].relay.upstream_grace(1.0), timeout=10) == 1.0
    finally:
        for r in (*relays.values(), rack):
            r.stop()
        silent.close()
        stuck.set()
        hung.stop(0)
        coordinator.stop()


def _never_answering_server(stuck: threading.Event) -> tuple[grpc.Server, int]:
    """A gRPC server whose Settings call is taken and not answered until `stuck` is set (a
    coordinator stuck after accepting the call)."""

    def settings(request: bytes, context: grpc.ServicerContext) -> bytes:
        stuck.wait(30)
        return b""

    server = grpc.server(ThreadPoolExecutor(2))
    handler = grpc.unary_unary_rpc_method_handler(settings)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, {"Settings": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_a_bad_upstream_address_is_named_by_the_relays_flag() -> None:
    from cohortgate.coordinator.codec.channel import ClientSecurity
    from cohortgate.coordinator.contract.settings import SettingError
    from cohortgate.coordinator.edge.relay import Relay

    with pytest.raises(SettingError) as caught:
        Relay("http://127.0.0.1:7070", ClientSecurity())
    assert str(caught.value) == (
        "--upstream=http://127.0.0.1:7070: 'http://127.0.0.1:7070' is not HOST:PORT (for "
        "example 127.0.0.1:7070 or [::1]:7070; no scheme, no path)"
    )
