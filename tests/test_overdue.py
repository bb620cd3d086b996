"""A join grpc's deadline does not end is ended by the agent (agent/client.py, OVERDUE_S).

grpc's client deadline was seen not to end a join: after the replica it had reached was
stopped with SIGTERM, a rank's call stayed open for an hour, its 60 s deadline long past and no
connection left (1 in ~100 runs of the rolling-update test in test_ha.py). That cannot be made
to happen on demand, so these tests give a real call to a real coordinator no grpc deadline at
all and check the agent's own timer."""

from __future__ import annotations

import time

import grpc
import pytest

from cohortgate.agent.client import Overdue, cancelled_when_overdue
from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec import wire
from tests.helpers import InProcessCoordinator, join_request, manifest_of

JOIN_DEADLINE = 60.0  # the coordinator never ends these joins itself


@pytest.mark.timeout(30)
def test_a_join_still_open_past_its_time_is_cancelled_and_said_to_be_overdue(
    coord: InProcessCoordinator,
) -> None:
    m = manifest_of()
    with grpc.insecure_channel(coord.addr) as channel:
        call = pb_grpc.CohortServiceStub(channel).Join(join_request("late", 0, 2, m))
        started = time.monotonic()
        with pytest.raises(Overdue) as err, cancelled_when_overdue(call, 1.0):
            for _ in call:  # progress events; rank 1 never comes
                pass
        took = time.monotonic() - started
    assert str(err.value) == "the call was still open 1s after it started"
    assert 1.0 <= took < 10.0, took


@pytest.mark.timeout(30)
def test_a_call_that_ends_in_time_is_left_alone_and_its_errors_are_its_own(
    coord: InProcessCoordinator,
) -> None:
    m = manifest_of()
    with grpc.insecure_channel(coord.addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        request = join_request("alone", 0, 1, m)
        call = stub.Join(request)
        with cancelled_when_overdue(call, 3.0):
            for event in call:
                if event.HasField("manifest_request"):  # the first of its signature
                    answer = wire.manifest_answer(request, event.manifest_request.round, m)
                    stub.UploadManifestChunks(wire.upload_chunks(answer), timeout=10)
                if event.HasField("verdict"):
                    assert event.verdict.outcome == pb.Verdict.OUTCOME_FORMED
        time.sleep(3.5)  # the timer, had it not been stopped, would have fired by now
        assert call.code() is grpc.StatusCode.OK
        # a call that fails before its time keeps its own error (not Overdue)
        bad = stub.Join(join_request("", 0, 1, m))
        with pytest.raises(grpc.RpcError) as err, cancelled_when_overdue(bad, 5.0):
            list(bad)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.timeout(30)
def test_a_rank_whose_joins_go_overdue_gives_up_in_time_and_says_why(
    coord: InProcessCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The join loop takes an overdue call as a deadline: it tries again while time is left,
    then gives up with the agent's words. (The timer is set to fire before grpc's deadline
    here, which is how it looks when grpc's does not fire at all.)"""
    from cohortgate.agent import client
    from cohortgate.agent.torchrun import CohortgateError
    from tests.launches import agent_rank

    monkeypatch.setattr(client, "OVERDUE_S", -2.0)  # 3 s joins: cancelled after 1 s
    started = time.monotonic()
    with pytest.raises(CohortgateError) as err:
        agent_rank(coord.addr, "overdue", 0, 2, manifest_of(), timeout_s=3)
    assert time.monotonic() - started < 10
    said = str(err.value)
    assert said.startswith(f"no verdict from the cohortgate coordinator at {coord.addr} within 3s")
    assert "still open" in said and "cancelled by the agent" in said, said
