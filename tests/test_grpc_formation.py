"""Formation over real gRPC: a real coordinator on loopback, real clients, one thread per rank."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from tests.helpers import (
    InProcessCoordinator,
    RankResult,
    join_request,
    manifest_of,
    run_cohort,
    run_rank,
    wait_joined,
)

FORMED = pb.Verdict.OUTCOME_FORMED
REFUSED = pb.Verdict.OUTCOME_REFUSED


JOIN_DEADLINE = 5.0  # the conftest `coord` fixture's deadline


def test_identical_ranks_form_and_get_rank0s_endpoint(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    results = run_cohort(coord.addr, "job-a", dict.fromkeys(range(4), m))
    for r in results:
        assert r.error is None, r.error
        assert r.verdict is not None and r.verdict.outcome == FORMED
        assert r.verdict.init_method == "tcp://127.0.0.1:29999"
        assert r.verdict.world_size == 4 and r.verdict.round == 1
    assert len({r.verdict.cohort_id for r in results if r.verdict}) == 1
    # In the normal case exactly one manifest crosses the wire, whatever the world size.
    assert sum(r.manifest_requests for r in results) == 1


def test_no_rank_learns_the_endpoint_before_formation(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(run_rank, coord.addr, join_request("gate", 0, 2, m), m)
        wait_joined(coord.addr, "gate", 1)
        time.sleep(0.6)
        assert not waiting.done()
        late = run_rank(coord.addr, join_request("gate", 1, 2, m), m)
        early = waiting.result(timeout=10)
    assert early.progress, "a waiting rank receives progress"
    assert early.progress[0].message == "1/2 ranks joined, waiting for ranks 1"
    assert all(p.joined < 2 for p in early.progress)
    assert early.verdict is not None and late.verdict is not None
    assert early.verdict.init_method == late.verdict.init_method == "tcp://127.0.0.1:29999"


def test_mismatch_refuses_every_rank_with_the_same_report(coord: InProcessCoordinator) -> None:
    ref, wide = manifest_of(4), manifest_of(8)
    results = run_cohort(coord.addr, "job-b", {0: ref, 1: ref, 2: wide, 3: ref})
    reports = {r.verdict.refusal.report for r in results if r.verdict}
    assert len(reports) == 1 and all(r.verdict.outcome == REFUSED for r in results if r.verdict)
    report = reports.pop()
    assert "differs:   signature" in report and "1 rank [2] on 1 host host0" in report
    assert "first difference at position 0: 'fc.weight' float32[4, 8] vs float32[8, 8]" in report
    refusal = results[0].verdict.refusal if results[0].verdict else None
    assert refusal is not None and refusal.cause == pb.Refusal.CAUSE_SIGNATURE_MISMATCH
    ranks = [c.ranks for c in refusal.classes]
    assert ranks == ["0-1,3", "2"]
    diff = refusal.classes[1].diff
    assert diff.available and diff.first_difference.position == 0
    assert [c.name for c in diff.shape_changed] == ["fc.weight", "fc.bias"]
    assert sum(r.manifest_requests for r in results) == 2  # one per distinct signature


def test_a_heavy_decision_made_off_the_loop_gives_the_same_verdicts(
    coord: InProcessCoordinator,
) -> None:
    """Cohorts above `offload_above` are decided in a worker thread, on a snapshot."""
    ref, wide = manifest_of(4), manifest_of(8)
    cohorts = {0: ref, 1: ref, 2: wide, 3: ref}
    offloaded = coord.running.coordinator.observer.metrics.offloaded._value.get
    on_loop = run_cohort(coord.addr, "heavy", cohorts)
    assert coord.call(offloaded) == 0
    coord.running.coordinator.offload_above = 0  # every complete cohort is heavy now
    off_loop = run_cohort(coord.addr, "heavy", cohorts, launch="2")  # round 2, a relaunch
    # Once or twice: a second time when a manifest arrived after the first decision.
    assert coord.call(offloaded) >= 1, "round 2 was decided in a worker"
    formed = run_cohort(coord.addr, "heavy-formed", dict.fromkeys(range(3), ref))
    for a, b in zip(on_loop, off_loop, strict=True):
        assert a.verdict is not None and b.verdict is not None
        assert b.verdict.round == 2
        assert b.verdict.refusal.report == a.verdict.refusal.report.replace("round 1", "round 2")
        assert b.verdict.refusal.classes == a.verdict.refusal.classes
    assert all(r.verdict is not None and r.verdict.outcome == FORMED for r in formed)


@pytest.mark.slow
def test_a_silent_manifest_holder_is_passed_over_for_another_rank_of_its_signature(
    coord: InProcessCoordinator,
) -> None:
    """Rank 0 joins first (so it is asked for the manifest) and never answers; rank 1 of
    the same signature is asked after ASK_AGAIN_S and the cohort forms verified, long
    before the 30 s manifest timeout."""
    m = manifest_of()
    silent = join_request("silent", 0, 3, m)
    with grpc.insecure_channel(coord.addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        events = iter(stub.Join(silent, timeout=60))
        first = next(events)
        assert first.WhichOneof("event") == "manifest_request"  # asked, and ignores it
        started = time.monotonic()
        others = run_cohort(coord.addr, "silent", {1: m, 2: m}, world=3, timeout=60)
        took = time.monotonic() - started
        verdict = next(e for e in events if e.WhichOneof("event") == "verdict").verdict
    assert verdict.outcome == FORMED
    assert verdict.reason == "[3/3 ranks joined, 1 signature]", "verified, not unverified"
    assert [r.manifest_requests for r in others] == [1, 0]
    assert took < 15, f"formed after {took:.1f}s: the silent holder held the cohort"


def test_dtype_difference_is_refused(coord: InProcessCoordinator) -> None:
    ref, f64 = manifest_of(), manifest_of(dtype="float64")
    results = run_cohort(coord.addr, "job-dt", {0: ref, 1: f64})
    report = results[0].verdict.refusal.report if results[0].verdict else ""
    assert "dtype changed: 2" in report
    assert "'fc.weight': float32[4, 8] -> float64[4, 8]" in report


def test_deadline_refuses_naming_the_missing_rank() -> None:
    coord = InProcessCoordinator(join_deadline=1.0, progress_interval=0.2)
    try:
        m = manifest_of()
        results = run_cohort(coord.addr, "job-dl", {0: m, 1: m, 2: m}, world=4)
    finally:
        coord.stop()
    for r in results:
        assert r.verdict is not None and r.verdict.outcome == REFUSED
        assert r.verdict.refusal.cause == pb.Refusal.CAUSE_DEADLINE
        assert r.verdict.refusal.missing_ranks == "3"
        assert r.verdict.refusal.present_ranks == "0-2"
        assert "missing ranks: 3" in r.verdict.refusal.report


def _expect_error(result_error: grpc.RpcError | None, code: grpc.StatusCode, *parts: str) -> None:
    assert result_error is not None, "expected an error"
    assert result_error.code() == code, result_error
    for part in parts:
        assert part in (result_error.details() or ""), result_error.details()


def test_duplicate_rank_is_refused_to_the_newcomer(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    first = join_request("dup", 1, 2, m, incarnation="first-incarnation")
    with ThreadPoolExecutor(max_workers=1) as pool:
        holder = pool.submit(run_rank, coord.addr, first, m)
        wait_joined(coord.addr, "dup", 1)
        dup = run_rank(coord.addr, join_request("dup", 1, 2, m, incarnation="second"), m)
        _expect_error(
            dup.error, grpc.StatusCode.ALREADY_EXISTS, "rank 1", "first-incarnation", "second"
        )
        run_rank(coord.addr, join_request("dup", 0, 2, m), m)
        assert holder.result(timeout=10).verdict is not None


def test_out_of_range_rank_and_world_size_disagreement(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    out = run_rank(coord.addr, join_request("range", 5, 4, m), m)
    _expect_error(out.error, grpc.StatusCode.INVALID_ARGUMENT, "rank 5", "[0, 4)")
    with ThreadPoolExecutor(max_workers=1) as pool:
        holder = pool.submit(run_rank, coord.addr, join_request("range", 0, 2, m), m)
        wait_joined(coord.addr, "range", 1)
        bad = run_rank(coord.addr, join_request("range", 1, 8, m), m)
        _expect_error(
            bad.error, grpc.StatusCode.FAILED_PRECONDITION, "world size 8", "world size 2"
        )
        run_rank(coord.addr, join_request("range", 1, 2, m), m)
        assert holder.result(timeout=10).verdict is not None


def test_protocol_version_mismatch_is_named(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    r = run_rank(coord.addr, join_request("proto", 0, 1, m, protocol_version=3), m)
    _expect_error(
        r.error,
        grpc.StatusCode.FAILED_PRECONDITION,
        f"agent speaks protocol 3, coordinator {wire.PROTOCOL_VERSION}",
    )


@pytest.mark.parametrize(
    ("overrides", "code", "text"),
    [
        ({"signature": b"short"}, grpc.StatusCode.INVALID_ARGUMENT, "32 bytes"),
        ({"job_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "job_id is empty"),
        ({"world_size": 0}, grpc.StatusCode.INVALID_ARGUMENT, "world_size is 0"),
        ({"world_size": 1 << 30}, grpc.StatusCode.RESOURCE_EXHAUSTED, "above this coordinator"),
        ({"init_method": ""}, grpc.StatusCode.INVALID_ARGUMENT, "rank 0 offered no init_method"),
        ({"host": "a\x00b"}, grpc.StatusCode.INVALID_ARGUMENT, "non-printable"),
    ],
)
def test_malformed_joins_get_clear_errors(
    coord: InProcessCoordinator, overrides: dict[str, object], code: grpc.StatusCode, text: str
) -> None:
    m = manifest_of()
    r = run_rank(coord.addr, join_request("bad", 0, 2, m, **overrides), m)
    _expect_error(r.error, code, text)


def test_manifest_that_does_not_hash_to_its_signature(coord: InProcessCoordinator) -> None:
    claimed, other = manifest_of(4), manifest_of(8)
    with ThreadPoolExecutor(max_workers=2) as pool:
        liar = pool.submit(
            run_rank, coord.addr, join_request("liar", 0, 2, claimed), claimed, 30.0, other
        )
        wait_joined(coord.addr, "liar", 1)  # the liar joins first: it is asked for the manifest
        honest = pool.submit(run_rank, coord.addr, join_request("liar", 1, 2, claimed), claimed)
        liar_result, honest_result = liar.result(timeout=30), honest.result(timeout=30)
    _expect_error(
        liar_result.upload_error,
        grpc.StatusCode.INVALID_ARGUMENT,
        "hashes to",
        claimed.signature().hex()[:12],
    )
    for result in (liar_result, honest_result):
        verdict = result.verdict
        assert verdict is not None and verdict.outcome == REFUSED
        assert verdict.refusal.cause == pb.Refusal.CAUSE_MANIFEST_INVALID
        assert "rank 0 (host host0) hashes to" in verdict.refusal.report


def _upload(stub: Any, req: pb.JoinRequest, manifest: pb.Manifest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.UploadManifest(
            pb.UploadManifestRequest(
                job_id=req.job_id,
                round=1,
                rank=req.rank,
                incarnation=req.incarnation,
                signature=req.signature,
                manifest=manifest,
            ),
            timeout=5,
        )
    return err.value


def test_a_members_upload_with_invalid_manifest_fields_names_the_field(
    coord: InProcessCoordinator,
) -> None:
    m = manifest_of()
    req = join_request("bad-fields", 0, 2, m)
    with grpc.insecure_channel(coord.addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        call = stub.Join(req, timeout=30)
        next(iter(call))  # a member now, waiting for rank 1
        bad = pb.Manifest(
            format=1,
            entries=[
                pb.ManifestEntry(kind=pb.ManifestEntry.KIND_PARAMETER, name="w", dtype="Float!")
            ],
        )
        error = _upload(stub, req, bad)
        huge = pb.Manifest(
            format=1,
            entries=[pb.ManifestEntry(kind=pb.ManifestEntry.KIND_PARAMETER, name="w" * 1000)] * 200,
        )
        too_big = _upload(stub, req, huge)  # 3 entries announced, 200 KB sent
        call.cancel()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a canonical dtype" in (error.details() or "")
    assert too_big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "more than its 3-entry manifest can take" in (too_big.details() or "")


def test_a_non_members_upload_is_refused_before_its_payload_is_decoded(
    coord: InProcessCoordinator,
) -> None:
    head = pb.UploadManifestHeader(
        job_id="nobody", round=1, rank=0, incarnation="x", signature=b"s" * 32
    )
    # field 6 (the manifest) holding bytes that are no message: decoding it would fail
    data = head.SerializeToString() + b"\x32\x05\xff\xff\xff\xff\xff"
    with grpc.insecure_channel(coord.addr) as channel, pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/cohortgate.v1.CohortService/UploadManifest")(data, timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
    assert "no round 1 of job 'nobody'" in (err.value.details() or "")


def test_two_jobs_interleaved_do_not_interfere(coord: InProcessCoordinator) -> None:
    a, b = manifest_of(4), manifest_of(8)
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures: list[Future[RankResult]] = []
        for r in range(3):
            futures.append(pool.submit(run_rank, coord.addr, join_request("job-x", r, 3, a), a))
            futures.append(pool.submit(run_rank, coord.addr, join_request("job-y", r, 3, b), b))
        results = [f.result(timeout=30) for f in futures]
    by_job: dict[str, set[str]] = {}
    for result in results:
        assert result.verdict is not None and result.verdict.outcome == FORMED, result.error
        by_job.setdefault(result.verdict.job_id, set()).add(result.verdict.cohort_id)
    assert set(by_job) == {"job-x", "job-y"}
    assert all(len(ids) == 1 for ids in by_job.values())


def test_new_round_after_a_verdict_and_over_round_refused(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    first = run_cohort(coord.addr, "rounds", dict.fromkeys(range(2), m))
    assert {r.verdict.round for r in first if r.verdict} == {1}
    second = run_cohort(coord.addr, "rounds", dict.fromkeys(range(2), m), launch="2")
    assert {r.verdict.round for r in second if r.verdict} == {2}
    late = run_rank(coord.addr, join_request("rounds", 1, 2, m, round=1), m)
    _expect_error(late.error, grpc.StatusCode.FAILED_PRECONDITION, "round 1", "is over")


def test_a_dropped_rank_frees_its_place_for_a_restart(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    with grpc.insecure_channel(coord.addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        call = stub.Join(join_request("drop", 1, 2, m, incarnation="old"), timeout=10)
        next(iter(call))  # joined and waiting
        call.cancel()
    deadline = time.monotonic() + 5
    while True:
        cohort = coord.call(lambda: coord.running.coordinator.find("drop"))
        assert cohort is not None
        if 1 not in cohort.state.members:
            break
        assert time.monotonic() < deadline, "the dropped rank was never released"
        time.sleep(0.05)
    assert [d.incarnation for d in cohort.state.departures] == ["old"]
    results = run_cohort(coord.addr, "drop", dict.fromkeys(range(2), m))
    assert all(r.verdict is not None and r.verdict.outcome == FORMED for r in results)


def test_verdict_is_replayed_to_the_same_incarnation(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    requests = [join_request("replay", r, 2, m) for r in range(2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(run_rank, coord.addr, q, m) for q in requests]
        first = [f.result(timeout=30) for f in futures]
    again = run_rank(coord.addr, requests[1], m)
    assert again.verdict is not None and first[1].verdict is not None
    assert again.verdict.cohort_id == first[1].verdict.cohort_id
    assert again.verdict.round == 1


def test_manifest_uploader_that_leaves_is_replaced(coord: InProcessCoordinator) -> None:
    m = manifest_of()
    seen = threading.Event()
    with grpc.insecure_channel(coord.addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        call = stub.Join(join_request("succ", 0, 3, m), timeout=10)
        for event in call:
            if event.WhichOneof("event") == "manifest_request":
                seen.set()
                break
        with ThreadPoolExecutor(max_workers=1) as pool:
            waiting = pool.submit(run_rank, coord.addr, join_request("succ", 1, 3, m), m)
            wait_joined(coord.addr, "succ", 2)
            call.cancel()  # rank 0 leaves without uploading: rank 1 must be asked instead
            results = run_cohort(coord.addr, "succ", {0: m, 2: m}, world=3)
            inheritor = waiting.result(timeout=15)
    assert seen.is_set()
    assert inheritor.manifest_requests == 1
    assert all(r.verdict is not None and r.verdict.outcome == FORMED for r in results)


def _unused(_: Manifest, __: Entry, ___: Kind) -> None:  # keep imports meaningful for types
    return None


def test_decided_jobs_leave_memory_but_their_verdicts_replay_from_history() -> None:
    coord = InProcessCoordinator(job_retention=0.5, progress_interval=0.2)
    try:
        m = manifest_of()
        requests = [join_request("evicted", r, 2, m) for r in range(2)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            first = [
                f.result(timeout=30)
                for f in [pool.submit(run_rank, coord.addr, q, m) for q in requests]
            ]
        give_up = time.monotonic() + 10
        while coord.call(lambda: coord.running.coordinator.store.holds("evicted")):
            assert time.monotonic() < give_up, "the decided job never left memory"
            time.sleep(0.1)
        again = run_rank(coord.addr, requests[0], m)
    finally:
        coord.stop()
    assert first[0].verdict is not None and again.verdict == first[0].verdict


def test_calls_that_complete_within_the_progress_interval_get_only_their_verdict() -> None:
    """The first progress event waits one interval: a cohort that forms sooner sends each
    call one message, its verdict; a rank that waits longer hears its round."""
    m = manifest_of()
    coord = InProcessCoordinator(progress_interval=3.0)
    try:
        fast = run_cohort(coord.addr, "fast", dict.fromkeys(range(4), m), world=4)
        assert [r.progress for r in fast] == [[]] * 4, "nothing but the verdict"
        assert all(r.verdict is not None and r.verdict.outcome == FORMED for r in fast)
        with ThreadPoolExecutor(1) as pool:
            early = pool.submit(run_rank, coord.addr, join_request("slow", 0, 2, m), m)
            wait_joined(coord.addr, "slow", 1)
            time.sleep(4.0)  # past one interval: rank 0 hears its round
            late = run_rank(coord.addr, join_request("slow", 1, 2, m), m)
            first = early.result(timeout=30)
        assert [p.round for p in first.progress] == [1], first.progress
        assert first.progress[0].message == "1/2 ranks joined, waiting for ranks 1"
        assert late.progress == [] and late.verdict is not None and first.verdict is not None
        assert late.verdict.cohort_id == first.verdict.cohort_id
    finally:
        coord.stop()


def test_a_join_cut_before_its_first_progress_rejoins_the_same_round() -> None:
    """A call cut before it heard its round (the agent's and the relay's round pin comes
    from the first progress event) re-joins without one: it lands in the round still open,
    not a new one, and the cohort forms once."""
    m = manifest_of()
    coord = InProcessCoordinator(progress_interval=5.0)
    try:
        with ThreadPoolExecutor(2) as pool:
            holder = pool.submit(run_rank, coord.addr, join_request("pin", 0, 3, m), m)
            cut = join_request("pin", 1, 3, m)
            with grpc.insecure_channel(coord.addr) as channel:
                call = pb_grpc.CohortServiceStub(channel).Join(cut, timeout=30)
                wait_joined(coord.addr, "pin", 2)  # joined, and heard nothing yet
                call.cancel()
            again = pool.submit(run_rank, coord.addr, cut, m)  # same incarnation, round 0
            time.sleep(0.5)
            last = run_rank(coord.addr, join_request("pin", 2, 3, m), m)
            results = [holder.result(timeout=30), again.result(timeout=30), last]
        verdicts = [r.verdict for r in results]
        assert all(v is not None and v.outcome == FORMED and v.round == 1 for v in verdicts)
        assert len({v.cohort_id for v in verdicts if v is not None}) == 1
    finally:
        coord.stop()
