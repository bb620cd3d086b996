"""JoinPoll, JoinGroup as a long poll: the relay's hop to the coordinator. One answer per
call; between calls the members stay held for JOIN_POLL_LINGER_S; a call with fewer members
is the others' leave; the stream (agents and relays of 0.2) is served beside it."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.contract.manifest import Manifest
from cohortgate.coordinator.service.admission import JOIN_POLL_LINGER_S
from tests.helpers import (
    InProcessCoordinator,
    join_request,
    joined,
    manifest_of,
    run_rank,
    wait_joined,
)

pytestmark = pytest.mark.timeout(60)

FORMED = pb.Verdict.OUTCOME_FORMED


def polls(
    addr: str, members: list[pb.JoinRequest], manifest: Manifest, *, again: bool = True
) -> list[pb.JoinEvent]:
    """A relay's polls: upload when asked, pin the round from progress, call again with the
    same members until the verdict (or, `again` False, stop after the first answer)."""
    answers: list[pb.JoinEvent] = []
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        while True:
            event = stub.JoinPoll(pb.JoinGroupRequest(members=members), timeout=30)
            answers.append(event)
            kind = event.WhichOneof("event")
            if kind == "manifest_request":
                asked = next(m for m in members if m.rank == event.manifest_request.rank)
                stub.UploadManifest(
                    wire.manifest_answer(asked, event.manifest_request.round, manifest),
                    timeout=30,
                )
            elif kind == "progress":
                for m in members:
                    m.round = event.progress.round
            if kind == "verdict" or not again:
                return answers


def test_polls_form_a_cohort_with_a_streaming_rank_and_upload_once(
    coord: InProcessCoordinator,
) -> None:
    """Two relays' groups poll, an agent of 0.2 streams: one cohort, one verdict each, one
    manifest asked and answered however many calls the polls took."""
    m = manifest_of()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(polls, coord.addr, [join_request("p", r, 5, m) for r in (0, 1)], m)
        wait_joined(coord.addr, "p", 2)
        time.sleep(0.5)  # past a progress interval (0.2 s): the group polls again
        second = pool.submit(polls, coord.addr, [join_request("p", r, 5, m) for r in (2, 3)], m)
        wait_joined(coord.addr, "p", 4)
        streamed = run_rank(coord.addr, join_request("p", 4, 5, m), m)
        answers = [first.result(timeout=30), second.result(timeout=30)]
    verdicts = [a[-1].verdict for a in answers] + [streamed.verdict]
    assert all(v is not None and v.outcome == FORMED for v in verdicts), verdicts
    assert len({v.cohort_id for v in verdicts if v is not None}) == 1
    assert len(answers[0]) >= 3, "progress, then polled again, until the verdict"
    asks = [e for a in answers for e in a if e.WhichOneof("event") == "manifest_request"]
    assert len(asks) + streamed.manifest_requests == 1, (asks, streamed.manifest_requests)


def test_an_answered_poll_not_made_again_leaves_after_the_linger(
    coord: InProcessCoordinator,
) -> None:
    m = manifest_of()
    (answer,) = polls(coord.addr, [join_request("gone", r, 3, m) for r in (0, 1)], m, again=False)
    assert answer.WhichOneof("event") in ("progress", "manifest_request")
    answered_at = time.monotonic()
    assert joined(coord.addr, "gone") == 2, "held between calls"
    while joined(coord.addr, "gone"):
        assert time.monotonic() - answered_at < JOIN_POLL_LINGER_S + 2, "never left"
        time.sleep(0.05)
    assert time.monotonic() - answered_at > JOIN_POLL_LINGER_S - 1, "left before the linger"


def test_a_poll_with_fewer_members_is_the_others_leave_at_once(
    coord: InProcessCoordinator,
) -> None:
    """A relay whose rank died polls again without it: the coordinator drops it then, so
    the cohort cannot form with it (not JOIN_POLL_LINGER_S later)."""
    m = manifest_of()
    members = [join_request("fewer", r, 3, m) for r in (0, 1)]
    polls(coord.addr, members, m, again=False)
    with ThreadPoolExecutor(1) as pool:
        rest = pool.submit(polls, coord.addr, members[:1], m)
        give_up = time.monotonic() + 2
        while joined(coord.addr, "fewer") != 1:
            assert time.monotonic() < give_up, "rank 1 still held after the poll without it"
            time.sleep(0.02)
        late = [join_request("fewer", r, 3, m) for r in (1, 2)]
        answers = polls(coord.addr, late, m)
        first = rest.result(timeout=30)
    assert answers[-1].verdict.outcome == FORMED
    assert first[-1].verdict.cohort_id == answers[-1].verdict.cohort_id


def test_an_upload_ask_is_answered_once_across_polls(coord: InProcessCoordinator) -> None:
    """The relay passes an ask to its rank and polls again at once, before the upload: the
    next answers are not the same ask again (as on a stream, each ask is told once), and a
    quiet group that has its round hears nothing more until the verdict."""
    m = manifest_of()
    members = [join_request("ask", r, 3, m, quiet=True) for r in (0, 1)]
    with grpc.insecure_channel(coord.addr) as channel, ThreadPoolExecutor(1) as pool:
        stub = pb_grpc.CohortServiceStub(channel)

        def poll() -> pb.JoinEvent:
            event: pb.JoinEvent = stub.JoinPoll(pb.JoinGroupRequest(members=members), timeout=30)
            return event

        kinds: list[str] = []
        while not kinds or kinds[-1] != "manifest_request":
            event = poll()
            kinds.append(str(event.WhichOneof("event")))
            assert kinds.count("progress") <= 1, kinds
            if kinds[-1] == "progress":
                for member in members:
                    member.round = event.progress.round
        asked = event.manifest_request
        if "progress" not in kinds:  # the round, as the first progress would have named it
            event = poll()
            assert event.WhichOneof("event") == "progress", event
            for member in members:
                member.round = event.progress.round
        next_answer = pool.submit(poll)
        time.sleep(0.6)  # three progress intervals: a repeated ask would be back by now
        assert not next_answer.done(), next_answer.result()
        uploader = next(x for x in members if x.rank == asked.rank)
        stub.UploadManifest(wire.manifest_answer(uploader, asked.round, m), timeout=30)
        last = run_rank(coord.addr, join_request("ask", 2, 3, m), m)
        assert last.verdict is not None
        assert next_answer.result(timeout=30).verdict.cohort_id == last.verdict.cohort_id


def test_a_cohort_completed_between_two_polls_forms_with_the_lingering_members(
    coord: InProcessCoordinator,
) -> None:
    """Members between two polls are alive (held for the next call), not calls that ended:
    the rank that completes the cohort gets its verdict at once, with them in it, and their
    next poll gets the same one (not a wait until they poll again, nor a cohort without
    them)."""
    m = manifest_of()
    members = [join_request("between", r, 3, m) for r in (0, 1)]
    (first,) = polls(coord.addr, members, m, again=False)
    assert first.WhichOneof("event") in ("progress", "manifest_request")
    last = run_rank(coord.addr, join_request("between", 2, 3, m), m, timeout=JOIN_POLL_LINGER_S - 2)
    assert last.verdict is not None and last.verdict.outcome == FORMED, last.error
    rest = polls(coord.addr, members, m)
    assert rest[-1].verdict.cohort_id == last.verdict.cohort_id
    assert rest[-1].verdict.world_size == 3
