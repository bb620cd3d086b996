"""Messages are capped (--max-message-bytes) so that no one message holds the event loop for
long; uploads larger than that travel in chunks, and the coordinator decides who sends one
(and whether its size is allowed) from the first chunk, before the rest is received."""

from __future__ import annotations

import pickle
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.cli.spawn import spawn
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.contract.layout import layout
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from cohortgate.coordinator.service import deciding
from tests.helpers import (
    InProcessCoordinator,
    join_request,
    log_events,
    manifest_of,
    run_rank,
    wait_joined,
)
from tests.launches import agent_rank, coordinator_process, kill_group

FORMED = pb.Verdict.OUTCOME_FORMED
MESSAGE_BYTES = 512 * 1024  # the smallest --max-message-bytes: 20,000 entries are over it
UPLOAD_BYTES = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def small() -> Iterator[InProcessCoordinator]:
    c = InProcessCoordinator(
        join_deadline=30.0,
        progress_interval=0.2,
        max_message_bytes=MESSAGE_BYTES,
        max_upload_bytes=UPLOAD_BYTES,
    )
    yield c
    c.stop()


def big(entries: int = 20_000) -> Manifest:
    return Manifest.of(
        Entry(Kind.PARAMETER, f"model.layers.{i}.weight", "float32", (4, 4), True)
        for i in range(entries)
    )


def test_an_upload_over_the_message_limit_forms_in_chunks(
    small: InProcessCoordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The rank asked keeps the ask however long the chunks take on a busy machine (the
    # coordinator asks another after ASK_AGAIN_S: 2 requests were seen under mutmut's load).
    monkeypatch.setattr(deciding, "ASK_AGAIN_S", 120.0)
    m = big()
    request = join_request("chunked", 0, 2, m)
    assert wire.manifest_answer(request, 1, m).ByteSize() > MESSAGE_BYTES
    with ThreadPoolExecutor(2) as pool:
        results = list(
            pool.map(lambda r: run_rank(small.addr, join_request("chunked", r, 2, m), m), range(2))
        )
    assert [r.upload_error for r in results] == [None, None]
    assert all(r.verdict is not None and r.verdict.outcome == FORMED for r in results), [
        r.error for r in results
    ]
    assert sum(r.manifest_requests for r in results) == 1


def test_the_agent_uploads_a_manifest_over_the_message_limit(small: InProcessCoordinator) -> None:
    m = big()
    with ThreadPoolExecutor(2) as pool:
        verdicts = list(pool.map(lambda r: agent_rank(small.addr, "agent", r, 2, m), range(2)))
    assert all(v.outcome == FORMED for v in verdicts), [v.reason for v in verdicts]


def test_a_join_over_the_message_limit_says_which_flag_to_raise(
    small: InProcessCoordinator,
) -> None:
    from cohortgate.agent.torchrun import CohortgateError

    decl = layout(0, tp=1)
    for i in range(20_000):
        decl.shard(f"model.layers.{i}.weight", (4, 4), (0, 0), (4, 4))
    with pytest.raises(CohortgateError) as err:
        agent_rank(small.addr, "wide", 0, 1, big(), timeout_s=10, layout=decl.build())
    assert "RESOURCE_EXHAUSTED" in str(err.value)
    assert "with a layout of 20000 pieces); raise the coordinator's --max-message-bytes" in str(
        err.value
    )


def test_a_large_layout_crosses_to_a_worker_as_columns_of_bytes() -> None:
    decl = layout(0, tp=1)
    for i in range(5_000):
        decl.shard(f"model.layers.{i}.weight", (4, 4), (0, 0), (4, 4))
    sent = wire.layout_from_pb(wire.layout_to_pb(decl.build()))
    data = pickle.dumps(sent)
    assert b"ShardPiece" not in data, "pickled piece by piece: holds the GIL ~2 us a piece"
    assert pickle.loads(data) == sent


def test_one_message_over_the_limit_is_refused_and_the_coordinator_serves_on(
    small: InProcessCoordinator,
) -> None:
    m = big()
    data = wire.manifest_answer(join_request("one", 0, 2, m), 1, m)
    with grpc.insecure_channel(small.addr) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.CohortServiceStub(channel).UploadManifest(data, timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_non_members_chunked_upload_ends_at_its_first_chunk(
    small: InProcessCoordinator,
) -> None:
    m = big(60_000)
    chunks = list(wire.upload_chunks(wire.manifest_answer(join_request("nobody", 0, 2, m), 1, m)))
    assert len(chunks) > 2
    release = threading.Event()

    def stream() -> Iterator[pb.UploadChunk]:
        yield chunks[0]
        release.wait(30)  # the rest never comes while the call lasts
        yield from chunks[1:]

    try:
        with grpc.insecure_channel(small.addr) as channel, pytest.raises(grpc.RpcError) as err:
            pb_grpc.CohortServiceStub(channel).UploadManifestChunks(stream(), timeout=10)
    finally:
        release.set()
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
    assert "no round 1 of job 'nobody'" in (err.value.details() or "")


def test_a_declared_size_over_the_upload_limit_is_refused_naming_it(
    small: InProcessCoordinator,
) -> None:
    head = pb.UploadManifestHeader(
        job_id="huge", round=1, rank=0, incarnation="x", signature=b"s" * 32
    ).SerializeToString()
    first = pb.UploadChunk(data=head, total_bytes=UPLOAD_BYTES + 1)
    with grpc.insecure_channel(small.addr) as channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.CohortServiceStub(channel).UploadManifestChunks(iter([first]), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"max_upload_bytes={UPLOAD_BYTES} (--max-upload-bytes)" in (err.value.details() or "")


def _answer_badly_first(
    addr: str, request: pb.JoinRequest, m: Manifest, errors: list[grpc.RpcError]
) -> pb.Verdict | None:
    """A rank that answers its manifest request with a short stream, then a long one,
    then the right one."""
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.CohortServiceStub(channel)
        for event in stub.Join(request, timeout=30):
            if event.WhichOneof("event") == "verdict":
                verdict: pb.Verdict = event.verdict
                return verdict
            if event.WhichOneof("event") != "manifest_request":
                continue
            chunks = list(
                wire.upload_chunks(wire.manifest_answer(request, event.manifest_request.round, m))
            )
            for bad in (chunks[:-1], [*chunks, pb.UploadChunk(data=b"\x00")]):
                try:
                    stub.UploadManifestChunks(iter(bad), timeout=10)
                except grpc.RpcError as exc:
                    errors.append(exc)
            stub.UploadManifestChunks(iter(chunks), timeout=10)
    return None


def test_a_stream_shorter_or_longer_than_declared_is_refused_and_may_be_sent_again(
    small: InProcessCoordinator,
) -> None:
    m = big()
    errors: list[grpc.RpcError] = []
    requests = [join_request("short", r, 2, m) for r in range(2)]
    with ThreadPoolExecutor(2) as pool:
        verdicts = list(
            pool.map(lambda req: _answer_badly_first(small.addr, req, m, errors), requests)
        )
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert "ended after" in (errors[0].details() or ""), errors[0].details()
    assert "sent more than the" in (errors[1].details() or ""), errors[1].details()
    assert all(v is not None and v.outcome == FORMED for v in verdicts)


def _sharded(job: str, rank: int) -> tuple[pb.JoinRequest, Manifest]:
    """Rank `rank` of 4 (tp=4) with a layout of 6,000 pieces: each join is ~400 KB."""
    decl = layout(rank, tp=4)
    for i in range(6000):
        decl.split(f"model.layers.{i}.mlp.up_proj.weight", (8, 4), 0, rank, 4)
    local = Manifest.of(
        Entry(Kind.PARAMETER, f"model.layers.{i}.mlp.up_proj.weight", "float32", (2, 4), True)
        for i in range(6000)
    )
    request = join_request(job, rank, 4, local)
    request.layout.CopyFrom(wire.layout_to_pb(decl.build()))
    return request, local


@pytest.mark.slow
def test_a_relay_cuts_its_group_at_the_coordinators_message_limit(tmp_path: Path) -> None:
    flags = ["--max-message-bytes", str(MESSAGE_BYTES)]
    ranks = [_sharded("cut", r) for r in range(4)]
    assert all(MESSAGE_BYTES / 2 < r.ByteSize() < MESSAGE_BYTES for r, _ in ranks)
    with coordinator_process("--log-level", "debug", *flags, tmp=tmp_path) as (addr, log):
        proc, port = spawn(
            tmp_path / "relay-port",
            ["--upstream", addr, "--listen", "127.0.0.1:0", "--local-ranks", "4", *flags],
            stdout=subprocess.DEVNULL,
            new_session=True,
            command="relay",
        )
        try:
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda rank: run_rank(f"127.0.0.1:{port}", *rank), ranks))
        finally:
            kill_group(proc)
        groups = [
            int(e["group"])
            for e in log_events(log)
            if e.get("event") == "ranks joined"
            for _ in range(int(e["count"]))
        ]
    assert [r.error for r in results] == [None] * 4
    assert all(r.verdict is not None and r.verdict.outcome == FORMED for r in results), [
        r.verdict.reason for r in results if r.verdict
    ]
    assert groups and max(groups) == 1, f"the coordinator saw groups {groups}"


def test_many_digests_are_combined_off_the_loop_and_name_the_tensor_that_differs() -> None:
    c = InProcessCoordinator(join_deadline=30.0, policy="weights=strict")
    try:
        m = big(12_000)  # over INLINE_DIGESTS: combined in a worker thread
        same = [b"\0" * 32] * len(m)
        other = [*same[:7], b"\1" * 32, *same[8:]]
        with ThreadPoolExecutor(2) as pool:
            verdicts = list(
                pool.map(
                    lambda r: agent_rank(c.addr, "dig", r, 2, m, digests=[same, other][r]),
                    range(2),
                )
            )
    finally:
        c.stop()
    assert {v.outcome for v in verdicts} == {pb.Verdict.OUTCOME_REFUSED}
    report = verdicts[0].refusal.report
    assert "model.layers.7.weight" in report and "model.layers.8.weight" not in report, report


def test_many_digests_of_the_wrong_count_are_refused_by_count_not_as_a_bug() -> None:
    """Over INLINE_DIGESTS the combination runs off the loop: a count that does not match
    the manifest must still be INVALID_ARGUMENT naming the counts, not INTERNAL."""
    c = InProcessCoordinator(join_deadline=30.0, policy="weights=strict", progress_interval=0.2)
    m = big(12_000)
    same = [b"\0" * 32] * len(m)
    other = [*same[:7], b"\1" * 32, *same[8:]]
    errors: list[grpc.RpcError] = []
    answered = threading.Event()

    def rank(r: int) -> None:
        request = join_request("count", r, 2, m, weights_digest=combine_named(m, [same, other][r]))
        request.weights_digest_format = 2
        with grpc.insecure_channel(c.addr) as channel:
            stub = pb_grpc.CohortServiceStub(channel)
            for event in stub.Join(request, timeout=20):
                kind = event.WhichOneof("event")
                if answered.is_set():
                    return  # the short upload was answered: the test is done
                if kind == "manifest_request":
                    stub.UploadManifestChunks(
                        wire.upload_chunks(
                            wire.manifest_answer(request, event.manifest_request.round, m)
                        ),
                        timeout=10,
                    )
                elif kind == "digest_request" and r == 1:
                    short = wire.digests_answer(request, event.digest_request.round, other[:-1])
                    try:
                        stub.UploadDigestsChunks(wire.upload_chunks(short), timeout=10)
                    except grpc.RpcError as exc:
                        errors.append(exc)
                    answered.set()
                    return
                elif kind == "digest_request":
                    answer = wire.digests_answer(request, event.digest_request.round, same)
                    stub.UploadDigestsChunks(wire.upload_chunks(answer), timeout=10)
                elif kind == "verdict":
                    return

    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(rank, range(2)))
    finally:
        c.stop()
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT], [
        e.details() for e in errors
    ]
    assert "11999 digests uploaded, but rank 1's manifest has 12000 entries" in (
        errors[0].details() or ""
    )


def combine_named(m: Manifest, digests: list[bytes]) -> bytes:
    from cohortgate.coordinator.contract.digests import combine

    return combine(zip((e.name for e in m.entries), digests, strict=True))


def test_a_rank_asked_for_its_manifest_that_leaves_hands_the_ask_to_another_at_once() -> None:
    """The first rank of a signature is asked for its manifest; its call ends before it
    uploads: the next rank of the signature is asked then, on its waiting call, not at its
    next progress event (30 s here)."""
    c = InProcessCoordinator(join_deadline=60.0, progress_interval=30.0)
    m = manifest_of()
    try:
        with grpc.insecure_channel(c.addr) as channel:
            stub = pb_grpc.CohortServiceStub(channel)
            first = stub.Join(join_request("handover", 0, 3, m), timeout=30)
            asked = next(iter(first))
            assert (
                asked.WhichOneof("event") == "manifest_request" and asked.manifest_request.rank == 0
            )
            second = stub.Join(join_request("handover", 1, 3, m), timeout=30)
            events: list[pb.JoinEvent] = []
            reader = threading.Thread(target=lambda: events.append(next(iter(second))))
            reader.start()
            wait_joined(c.addr, "handover", 2)
            first.cancel()  # rank 0 goes before uploading
            # Well inside deciding.ASK_AGAIN_S (5 s), after which a silent holder's ask moves
            # anyway: this is the departure's own hand-over.
            reader.join(timeout=2)
            assert events, "rank 1 was not asked within 2 s of rank 0 leaving"
            (event,) = events
            assert event.WhichOneof("event") == "manifest_request"
            assert event.manifest_request.rank == 1
            second.cancel()
    finally:
        c.stop()
