"""Scale paths: a whole job's joins at once, quiet ranks, and groups (JoinGroup); relays as
processes are tests/test_relays.py's."""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.codec.groups import as_classes
from cohortgate.coordinator.contract.manifest import Manifest
from tests.helpers import (
    InProcessCoordinator,
    join_async,
    join_request,
    manifest_of,
    run_async,
    run_cohort,
    run_rank,
    wait_joined,
)
from tests.launches import coordinator_process

FORMED = pb.Verdict.OUTCOME_FORMED
REFUSED = pb.Verdict.OUTCOME_REFUSED


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_whole_job_joining_at_once_reaches_the_coordinator(tmp_path: Path) -> None:
    """4096 joins in one burst. grpc core used to cancel the calls the Python server had not
    picked up yet (past 1,000 queued): those ranks never joined and the rest hung."""
    n = 4096
    m = manifest_of()
    with coordinator_process("--join-deadline", "120", "--log-level", "warning", tmp=tmp_path) as (
        addr,
        _,
    ):

        async def main() -> tuple[dict[str, int], dict[str, int]]:
            channels = [
                grpc.aio.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(16)
            ]
            outcomes: dict[str, int] = {}
            errors: dict[str, int] = {}

            async def rank(r: int) -> None:
                stub = pb_grpc.CohortServiceStub(channels[r % len(channels)])
                req = join_request("burst", r, n, m, quiet=r != 0)
                said, verdict = await join_async(stub, req, 150, m, retry=False)
                if verdict is None:
                    errors[said] = errors.get(said, 0) + 1
                else:
                    name = pb.Verdict.Outcome.Name(verdict.outcome)
                    outcomes[name] = outcomes.get(name, 0) + 1

            await asyncio.gather(*(rank(r) for r in range(n)))
            for c in channels:
                await c.close()
            return outcomes, errors

        outcomes, errors = run_async(main())
    assert errors == {}
    assert outcomes == {"OUTCOME_FORMED": n}


def test_quiet_ranks_get_the_first_progress_event_only(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    with ThreadPoolExecutor(3) as pool:
        loud = pool.submit(run_rank, coord.addr, join_request("q", 0, 3, m), m)
        quiet = pool.submit(run_rank, coord.addr, join_request("q", 1, 3, m, quiet=True), m)
        # Both must be held before the clock starts: on a busy machine a thread's first
        # channel can take longer than the wait, and a rank that joins last gets no progress.
        wait_joined(coord.addr, "q", 2)
        time.sleep(1.5)  # ~7 progress intervals of 0.2 s
        last = run_rank(coord.addr, join_request("q", 2, 3, m, quiet=True), m)
        results = [loud.result(), quiet.result(), last]
    assert all(r.verdict is not None and r.verdict.outcome == FORMED for r in results)
    assert len(results[0].progress) >= 4
    assert len(results[1].progress) == 1 and results[1].progress[0].round == 1
    assert results[2].progress == [], "the rank that completes the cohort gets the verdict"


def join_group(
    addr: str,
    requests: list[pb.JoinRequest],
    uploads: dict[int, Manifest] | None = None,
    sent: str = "members",
) -> tuple[list[pb.JoinEvent], grpc.RpcError | None]:
    """One JoinGroup call, answering manifest requests with the named member's manifest;
    `sent`: the ranks one request each ("members", as older relays send them) or as
    classes ("classes", as relays send them now)."""
    group = as_classes(requests) if sent == "classes" else pb.JoinGroupRequest(members=requests)
    events: list[pb.JoinEvent] = []
    by_rank = {r.rank: r for r in requests}
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        try:
            for event in stub.JoinGroup(group, timeout=30):
                events.append(event)
                if event.WhichOneof("event") == "manifest_request":
                    asked = by_rank[event.manifest_request.rank]
                    stub.UploadManifest(
                        wire.manifest_answer(
                            asked, event.manifest_request.round, (uploads or {})[asked.rank]
                        ),
                        timeout=30,
                    )
        except grpc.RpcError as exc:
            return events, exc
    return events, None


@pytest.mark.parametrize("sent", ["members", "classes"])
def test_a_verdict_lists_64_hosts_a_class_and_counts_the_rest(
    coord: InProcessCoordinator, sent: str
) -> None:
    """Every rank receives the verdict: a class spanning 2,048 hosts must not put 22 KB of
    host names in each of its 16k messages."""
    m, wide = manifest_of(), manifest_of(width=8)
    manifests = {r: (wide if r >= 70 else m) for r in range(140)}
    requests = [join_request("hosts", r, 140, manifests[r], host=f"n{r:03d}") for r in range(140)]
    events, error = join_group(coord.addr, requests, manifests, sent)
    assert error is None, error
    verdict = events[-1].verdict
    assert verdict.outcome == REFUSED
    for cls in verdict.refusal.classes:
        assert cls.host_count == 70 and len(cls.hosts) == 64, (cls.host_count, len(cls.hosts))
        assert list(cls.hosts) == sorted(cls.hosts)


@pytest.mark.parametrize("sent", ["members", "classes"])
def test_groups_form_with_one_verdict_per_group(coord: InProcessCoordinator, sent: str) -> None:
    m, wide = manifest_of(), manifest_of(width=8)
    manifests = {r: (wide if r == 6 else m) for r in range(16)}
    groups = [
        [join_request("g", r, 16, manifests[r], host=f"node{g}") for r in range(4 * g, 4 * g + 4)]
        for g in range(4)
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda reqs: join_group(coord.addr, reqs, manifests, sent), groups))
    verdicts = []
    for events, error in results:
        assert error is None, error
        kinds = [e.WhichOneof("event") for e in events]
        assert kinds.count("verdict") == 1 and kinds[-1] == "verdict"
        verdicts.append(events[-1].verdict)
    assert {v.outcome for v in verdicts} == {REFUSED}
    assert len({v.SerializeToString() for v in verdicts}) == 1, "one verdict, the same bytes"
    report = verdicts[0].refusal.report
    assert "1 rank [6] on 1 host node1" in report, report
    asked = [
        e.manifest_request.rank
        for events, _ in results
        for e in events
        if e.WhichOneof("event") == "manifest_request"
    ]
    # One manifest per signature, each asked of one member by rank (the first to join it).
    assert len(asked) == 2 and 6 in asked, asked


def test_bad_groups_are_refused_with_invalid_argument(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    cases = {
        "appears twice": [join_request("b", 1, 4, m), join_request("b", 1, 4, m)],
        "one group holds ranks of one job": [
            join_request("b", 1, 4, m),
            join_request("other", 2, 4, m),
        ],
        "rank 7 is outside [0, 4)": [
            join_request("b", 1, 4, m),
            join_request("b", 7, 4, m),
        ],
        "no members": [],
    }
    for text, requests in cases.items():
        _, error = join_group(coord.addr, requests)
        assert error is not None and error.code() == grpc.StatusCode.INVALID_ARGUMENT, text
        assert text in (error.details() or ""), error.details()
    # None of them left a member behind: the job's ranks all join afresh and form.
    results = run_cohort(coord.addr, "b", dict.fromkeys(range(4), m))
    assert all(r.verdict is not None and r.verdict.outcome == FORMED for r in results)


def test_a_cancelled_group_frees_its_ranks(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    requests = [join_request("c", r, 4, m) for r in range(2)]
    channel = grpc.insecure_channel(coord.addr)
    call = pb_grpc.CohortServiceStub(channel).JoinGroup(
        pb.JoinGroupRequest(members=requests), timeout=30
    )
    first = next(e for e in call if e.WhichOneof("event") == "progress")
    assert first.progress.joined == 2
    call.cancel()
    channel.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        held = coord.call(lambda: len(coord.running.coordinator.find("c").state.members))  # type: ignore[union-attr]
        if held == 0:
            break
        time.sleep(0.05)
    assert held == 0
    results = run_cohort(coord.addr, "c", dict.fromkeys(range(4), m))  # new incarnations
    assert all(r.verdict is not None and r.verdict.outcome == FORMED for r in results)


def test_a_group_validates_what_its_members_share_once_and_each_difference_on_its_own() -> None:
    """A relay's group carries one host, launch, runtime and config many times: they are
    validated once per call, and a member whose value differs (a bad one) is still refused,
    named by its place in the group; the members that share a value share the result."""
    from cohortgate.coordinator.contract.errors import InvalidArgument, LimitExceeded
    from cohortgate.coordinator.edge.joins import group_intents

    m = manifest_of()

    def group(**bad: Any) -> pb.JoinGroupRequest:
        members = []
        for r in range(4):
            req = join_request("g", r, 4, m, host="node0", launch="store:1")
            req.runtime.torch_version = "2.13.0"
            req.config.fields.update({"hidden": "64", "layers": "2"})
            members.append(req)
        for field, value in bad.items():
            target = members[2]
            if field == "config":
                target.config.fields.update(value)
            elif field == "torch_version":
                target.runtime.torch_version = value
            else:
                setattr(target, field, value)
        return pb.JoinGroupRequest(members=members)

    intents = group_intents(group())
    assert [i.member.rank for i in intents] == [0, 1, 2, 3]
    assert intents[1].member.agreed["config"] == intents[3].member.agreed["config"]
    assert intents[1].member.runtime is intents[3].member.runtime, "validated once, shared"
    assert intents[0].member.runtime["torch_version"] == "2.13.0"
    for bad, error, said in (
        ({"host": "node\x00"}, InvalidArgument, "members[2] (rank 2): host"),
        ({"launch": "x" * 600}, InvalidArgument, "members[2] (rank 2): launch"),
        ({"torch_version": "2.13\x07"}, InvalidArgument, "members[2] (rank 2): runtime.torch"),
        ({"config": {"k": "v" * 2000}}, InvalidArgument, "members[2] (rank 2): config.k is"),
        ({"config": {f"f{i}": "1" for i in range(5000)}}, LimitExceeded, "members[2]"),
    ):
        with pytest.raises(error, match=re.escape(said)):
            group_intents(group(**bad))
