"""Hostile input against every RPC: no crash, only documented status codes, and a healthy
cohort forming alongside the whole time."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec import wire
from tests.helpers import InProcessCoordinator, manifest_of, run_cohort

# What the coordinator may answer (plus the client's own CANCELLED, and DEADLINE_EXCEEDED
# where the call may rightly wait: a join waiting for its cohort, a watch).
DOCUMENTED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

U32 = st.integers(min_value=0, max_value=2**32 - 1)
I64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
ODD_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=300),
    st.sampled_from(["", "\x00", "job\u202e", "\U0001f600" * 50, "a" * 5000, "../../etc", "*"]),
)


class Fuzzed:
    def __init__(self) -> None:
        self.coord = InProcessCoordinator(join_deadline=3.0, manifest_timeout=2.0)
        self.channel = grpc.insecure_channel(self.coord.addr)
        self.cohort = pb_grpc.CohortServiceStub(self.channel)
        self.status = pb_grpc.StatusServiceStub(self.channel)
        self.healthy: list[int] = []  # outcomes of the cohorts formed alongside
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._healthy_loop, daemon=True)
        self.thread.start()

    def _healthy_loop(self) -> None:
        m = manifest_of()
        n = 0
        while not self.stop.is_set():
            n += 1
            results = run_cohort(self.coord.addr, f"healthy-{n}", {0: m, 1: m}, timeout=20)
            self.healthy.extend(r.verdict.outcome if r.verdict else -1 for r in results)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.channel.close()
        self.coord.stop()


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Fuzzed]:
    f = Fuzzed()
    yield f
    f.close()
    assert f.healthy, "the healthy cohorts must have run"
    assert set(f.healthy) == {pb.Verdict.OUTCOME_FORMED}, "every healthy cohort formed"


def code_of(call: object, waits: bool = False) -> grpc.StatusCode:
    """The call's status; a unary call (`waits` False) that runs into its deadline is a hung
    handler, not an answer."""
    try:
        call()  # type: ignore[operator]
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()
        assert code in DOCUMENTED, f"{code}: {exc.details()}"
        assert waits or code is not grpc.StatusCode.DEADLINE_EXCEEDED, exc.details()
        return code
    return grpc.StatusCode.OK


runtime = st.builds(
    pb.RuntimeFacts,
    torch_version=ODD_TEXT,
    cuda_version=ODD_TEXT,
    device_type=ODD_TEXT,
    device_name=ODD_TEXT,
)
pieces = st.builds(
    pb.ShardPiece,
    tensor=ODD_TEXT,
    shape=st.lists(I64, max_size=5),
    offset=st.lists(I64, max_size=5),
    length=st.lists(I64, max_size=5),
    replicated=st.booleans(),
)
AXIS = st.one_of(st.sampled_from(["tp", "cp", "ep", "dp", "pp"]), ODD_TEXT)
layouts = st.builds(
    pb.Layout,
    format=st.one_of(st.just(1), U32),
    sizes=st.dictionaries(AXIS, U32, max_size=6),
    position=st.dictionaries(AXIS, U32, max_size=6),
    config=ODD_TEXT,
    pieces=st.lists(pieces, max_size=6),
)
fingerprints = st.builds(pb.Fingerprint, fields=st.dictionaries(ODD_TEXT, ODD_TEXT, max_size=8))
join_requests = st.builds(
    pb.JoinRequest,
    protocol_version=st.one_of(st.just(1), U32),
    job_id=ODD_TEXT,
    round=st.one_of(st.just(0), U32),
    rank=st.one_of(st.integers(0, 8), U32),
    world_size=st.one_of(st.integers(0, 8), U32),
    local_rank=U32,
    host=ODD_TEXT,
    pid=U32,
    incarnation=ODD_TEXT,
    signature=st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=80)),
    manifest_entries=U32,
    runtime=runtime,
    init_method=ODD_TEXT,
    layout=st.one_of(st.none(), layouts),
    weights_digest=st.one_of(st.just(b""), st.binary(min_size=32, max_size=32), st.binary()),
    weights_digest_format=st.one_of(st.just(2), U32),
    launch=ODD_TEXT,
    config=st.one_of(st.none(), fingerprints),
    code=st.one_of(st.none(), fingerprints),
    facts=st.one_of(st.none(), fingerprints),
)


@FUZZ
@given(request=join_requests, cancel_early=st.booleans())
def test_join_fuzz(fuzzed: Fuzzed, request: pb.JoinRequest, cancel_early: bool) -> None:
    def call() -> None:
        stream = fuzzed.cohort.Join(request, timeout=0.3)
        for _ in stream:
            if cancel_early:  # a truncated stream: the caller goes away mid-join
                stream.cancel()

    code_of(call, waits=True)


@pytest.mark.slow
@FUZZ
@given(members=st.lists(join_requests, max_size=4))
def test_join_group_fuzz(fuzzed: Fuzzed, members: list[pb.JoinRequest]) -> None:
    def call() -> None:
        for _ in fuzzed.cohort.JoinGroup(pb.JoinGroupRequest(members=members), timeout=0.3):
            pass

    code_of(call, waits=True)


# Who an upload claims to come from: any job, round, rank and incarnation.
UPLOADER = {"job": ODD_TEXT, "round_": U32, "rank": U32, "incarnation": ODD_TEXT}


@FUZZ
@given(
    **UPLOADER,
    digests=st.lists(st.binary(max_size=40), max_size=20),
    chunked=st.booleans(),
)
def test_upload_digests_fuzz(
    fuzzed: Fuzzed,
    job: str,
    round_: int,
    rank: int,
    incarnation: str,
    digests: list[bytes],
    chunked: bool,
) -> None:
    request = pb.UploadDigestsRequest(
        job_id=job, round=round_, rank=rank, incarnation=incarnation, digests=digests
    )
    if chunked:
        code_of(lambda: fuzzed.cohort.UploadDigestsChunks(wire.upload_chunks(request), timeout=5))
    else:
        code_of(lambda: fuzzed.cohort.UploadDigests(request, timeout=5))


@FUZZ
@given(
    chunks=st.lists(
        st.builds(
            pb.UploadChunk, data=st.binary(max_size=200), total_bytes=st.integers(0, 2**64 - 1)
        ),
        max_size=5,
    )
)
def test_upload_chunks_fuzz(fuzzed: Fuzzed, chunks: list[pb.UploadChunk]) -> None:
    code_of(lambda: fuzzed.cohort.UploadManifestChunks(iter(chunks), timeout=5))


entries = st.builds(
    pb.ManifestEntry,
    kind=st.integers(0, 5),
    name=ODD_TEXT,
    dtype=st.one_of(st.sampled_from(["float32", "bfloat16"]), ODD_TEXT),
    shape=st.lists(I64, max_size=70),
    requires_grad=st.booleans(),
)


@FUZZ
@given(
    **UPLOADER,
    signature=st.binary(max_size=40),
    fmt=st.one_of(st.just(1), U32),
    items=st.lists(entries, max_size=30),
)
def test_upload_fuzz(
    fuzzed: Fuzzed,
    job: str,
    round_: int,
    rank: int,
    incarnation: str,
    signature: bytes,
    fmt: int,
    items: list[pb.ManifestEntry],
) -> None:
    request = pb.UploadManifestRequest(
        job_id=job,
        round=round_,
        rank=rank,
        incarnation=incarnation,
        signature=signature,
        manifest=pb.Manifest(format=fmt, entries=items),
    )
    code_of(lambda: fuzzed.cohort.UploadManifest(request, timeout=5))
    code_of(lambda: fuzzed.cohort.UploadManifestChunks(wire.upload_chunks(request), timeout=5))


@pytest.mark.slow
@FUZZ
@given(job=ODD_TEXT, round_=U32)
def test_status_fuzz(fuzzed: Fuzzed, job: str, round_: int) -> None:
    code_of(lambda: fuzzed.status.ListCohorts(pb.ListCohortsRequest(job_id=job), timeout=5))
    code_of(
        lambda: fuzzed.status.GetCohort(pb.GetCohortRequest(job_id=job, round=round_), timeout=5)
    )
    code_of(
        lambda: fuzzed.status.GetVerdict(pb.GetVerdictRequest(job_id=job, round=round_), timeout=5)
    )

    def watch() -> None:
        stream = fuzzed.status.WatchCohorts(pb.WatchCohortsRequest(job_id=job), timeout=0.2)
        for _ in stream:
            pass

    code_of(watch, waits=True)


# Every method of both services (client-streaming ones get the bytes as one message).
METHODS = [
    (f"/{service.full_name}/{m.name}", m.server_streaming, m.client_streaming)
    for service in pb.DESCRIPTOR.services_by_name.values()
    for m in service.methods
]


@FUZZ
@given(method=st.sampled_from(METHODS), data=st.binary(max_size=300))
def test_raw_bytes_fuzz(fuzzed: Fuzzed, method: tuple[str, bool, bool], data: bytes) -> None:
    path, streaming, client_streaming = method
    if streaming:
        stream = fuzzed.channel.unary_stream(path)

        def call() -> None:
            for _ in stream(data, timeout=0.3):
                pass

        code = code_of(call, waits=True)
    elif client_streaming:
        code = code_of(lambda: fuzzed.channel.stream_unary(path)(iter([data]), timeout=5))
    else:
        code = code_of(lambda: fuzzed.channel.unary_unary(path)(data, timeout=5))
    assert code != grpc.StatusCode.INTERNAL


def test_garbage_gets_invalid_argument_not_internal(fuzzed: Fuzzed) -> None:
    with pytest.raises(grpc.RpcError) as err:
        fuzzed.channel.unary_unary("/cohortgate.v1.CohortService/UploadManifest")(
            b"\xff\xff\xff\xff", timeout=5
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid cohortgate.v1.UploadManifestRequest" in (err.value.details() or "")
