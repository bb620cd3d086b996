"""Tokens, TLS and mutual TLS, limits and exposure: each refusal with the right status code."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec.channel import ClientSecurity
from tests.helpers import InProcessCoordinator, join_request, manifest_of, run_cohort
from tests.launches import agent_rank, coordinator_process

TOKEN_A = "token-for-job-a-0123456789"
TOKEN_B = "token-for-job-b-0123456789"
ADMIN = "admin-token-0123456789abcdef"


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[InProcessCoordinator]:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# job tokens\n{TOKEN_A} job-a\n{TOKEN_B} job-b\n{ADMIN} *\n")
    c = InProcessCoordinator(tokens_file=tokens, join_deadline=10.0)
    yield c
    c.stop()


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def join_once(
    channel: grpc.Channel,
    job: str,
    metadata: list[tuple[str, str]],
    world: int = 1,
    rank: int = 0,
) -> pb.Verdict:
    """A one-rank cohort (or `rank` of a bigger one): join, upload when asked, return the
    verdict (or raise)."""
    m = manifest_of()
    stub = pb_grpc.CohortServiceStub(channel)
    request = join_request(job, rank, world, m)
    for event in stub.Join(request, timeout=10, metadata=metadata):
        kind = event.WhichOneof("event")
        if kind == "manifest_request":
            from cohortgate.coordinator.codec import wire

            stub.UploadManifest(
                wire.manifest_answer(request, event.manifest_request.round, m),
                timeout=10,
                metadata=metadata,
            )
        elif kind == "verdict":
            verdict: pb.Verdict = event.verdict
            return verdict
    raise AssertionError("no verdict")


def code_of(fn: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        fn()  # type: ignore[operator]
    return err.value.code()


def test_tokens_gate_joins_per_job(secured: InProcessCoordinator) -> None:
    with grpc.insecure_channel(secured.addr) as ch:
        assert code_of(lambda: join_once(ch, "job-a", [])) == grpc.StatusCode.UNAUTHENTICATED
        assert (
            code_of(lambda: join_once(ch, "job-a", bearer("wrong-token-0123456789")))
            == grpc.StatusCode.UNAUTHENTICATED
        )
        assert (
            code_of(lambda: join_once(ch, "job-b", bearer(TOKEN_A)))
            == grpc.StatusCode.PERMISSION_DENIED
        )
        assert join_once(ch, "job-a", bearer(TOKEN_A)).outcome == pb.Verdict.OUTCOME_FORMED
        assert join_once(ch, "job-b", bearer(ADMIN)).outcome == pb.Verdict.OUTCOME_FORMED


def test_tokens_gate_status_and_watch(secured: InProcessCoordinator) -> None:
    with grpc.insecure_channel(secured.addr) as ch:
        join_once(ch, "job-a", bearer(TOKEN_A))
        join_once(ch, "job-b", bearer(TOKEN_B))
        status = pb_grpc.StatusServiceStub(ch)
        no_token = lambda: status.ListCohorts(pb.ListCohortsRequest(), timeout=5)  # noqa: E731
        assert code_of(no_token) == grpc.StatusCode.UNAUTHENTICATED
        mine = status.ListCohorts(pb.ListCohortsRequest(), timeout=5, metadata=bearer(TOKEN_A))
        assert {c.job_id for c in mine.cohorts} == {"job-a"}, "a job token sees its job only"
        every = status.ListCohorts(pb.ListCohortsRequest(), timeout=5, metadata=bearer(ADMIN))
        assert {c.job_id for c in every.cohorts} == {"job-a", "job-b"}
        for call in (
            lambda: status.ListCohorts(
                pb.ListCohortsRequest(job_id="job-b"), timeout=5, metadata=bearer(TOKEN_A)
            ),
            lambda: status.GetCohort(
                pb.GetCohortRequest(job_id="job-b"), timeout=5, metadata=bearer(TOKEN_A)
            ),
            lambda: status.GetVerdict(
                pb.GetVerdictRequest(job_id="job-b"), timeout=5, metadata=bearer(TOKEN_A)
            ),
            lambda: next(
                status.WatchCohorts(
                    pb.WatchCohortsRequest(job_id="job-b"), timeout=5, metadata=bearer(TOKEN_A)
                )
            ),
        ):
            assert code_of(call) == grpc.StatusCode.PERMISSION_DENIED
        watch = status.WatchCohorts(pb.WatchCohortsRequest(), timeout=5, metadata=bearer(TOKEN_A))
        assert next(watch).job_id == "job-a"
        watch.cancel()
        record = status.GetVerdict(
            pb.GetVerdictRequest(job_id="job-a"), timeout=5, metadata=bearer(TOKEN_A)
        )
        assert record.outcome == "formed"


def test_status_page_needs_an_admin_token(secured: InProcessCoordinator) -> None:
    import urllib.error
    import urllib.request

    url = secured.metrics_url + "/status.json"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(url, timeout=5)
    assert err.value.code == 401
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN_A}"})
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(req, timeout=5)
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=5) as reply:
        assert reply.status == 200
    with urllib.request.urlopen(secured.metrics_url + "/metrics", timeout=5) as reply:
        assert reply.status == 200  # no job names in metrics: left open for Prometheus


def test_tls_server_refuses_plaintext_and_serves_verified_clients(pki: Path) -> None:
    c = InProcessCoordinator(tls_cert=pki / "server.pem", tls_key=pki / "server.key")
    try:
        with grpc.insecure_channel(c.addr) as plain:
            assert code_of(lambda: join_once(plain, "tls-job", [])) == grpc.StatusCode.UNAVAILABLE
        wrong_ca = ClientSecurity(tls=True, ca=pki / "client.pem")
        with wrong_ca.channel(c.addr) as ch:
            assert code_of(lambda: join_once(ch, "tls-job", [])) == grpc.StatusCode.UNAVAILABLE
        good = ClientSecurity(tls=True, ca=pki / "ca.pem")
        with good.channel(c.addr) as ch:
            assert join_once(ch, "tls-job", []).outcome == pb.Verdict.OUTCOME_FORMED
    finally:
        c.stop()


def test_with_tls_the_status_port_serves_https_and_never_plain_http(pki: Path) -> None:
    import ssl
    import urllib.request

    c = InProcessCoordinator(tls_cert=pki / "server.pem", tls_key=pki / "server.key")
    url = f"127.0.0.1:{c.running.metrics_port}"
    try:
        context = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with urllib.request.urlopen(f"https://{url}/healthz", context=context, timeout=10) as r:
            assert r.read() == b"ok\n"
        with pytest.raises(OSError):  # a plain-HTTP request gets no page (and no token)
            urllib.request.urlopen(f"http://{url}/healthz", timeout=10).read()
    finally:
        c.stop()


def test_a_token_protected_status_page_is_never_served_in_clear_beyond_loopback(
    tmp_path: Path,
) -> None:
    from cohortgate.coordinator.edge.config import ServeConfig

    tokens = tmp_path / "tokens"
    tokens.write_text("secret *\n")
    with pytest.raises(ValueError, match="admin token would cross the network in clear"):
        ServeConfig(
            metrics_listen="0.0.0.0:0", allow_remote=True, tokens_file=tokens, history="off"
        )


def test_mutual_tls_refuses_clients_without_a_certificate(pki: Path) -> None:
    c = InProcessCoordinator(
        tls_cert=pki / "server.pem", tls_key=pki / "server.key", tls_client_ca=pki / "ca.pem"
    )
    try:
        anonymous = ClientSecurity(tls=True, ca=pki / "ca.pem")
        with anonymous.channel(c.addr) as ch:
            assert code_of(lambda: join_once(ch, "mtls-job", [])) == grpc.StatusCode.UNAVAILABLE
        with_cert = ClientSecurity(
            tls=True, ca=pki / "ca.pem", cert=pki / "client.pem", key=pki / "client.key"
        )
        with with_cert.channel(c.addr) as ch:
            assert join_once(ch, "mtls-job", []).outcome == pb.Verdict.OUTCOME_FORMED
    finally:
        c.stop()


def test_agent_uses_token_and_tls_from_its_environment(pki: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_A} job-a\n")
    c = InProcessCoordinator(
        tokens_file=tokens, tls_cert=pki / "server.pem", tls_key=pki / "server.key"
    )
    env = {"COHORTGATE_TOKEN": TOKEN_A, "COHORTGATE_TLS_CA": str(pki / "ca.pem")}
    saved = {k: __import__("os").environ.get(k) for k in env}
    import os

    os.environ.update(env)
    try:
        verdict = agent_rank(c.addr, "job-a", 0, 1, manifest_of(), timeout_s=20)
        assert verdict.outcome == pb.Verdict.OUTCOME_FORMED
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        c.stop()


@pytest.mark.slow
def test_limits_name_the_limit_and_its_value() -> None:
    c = InProcessCoordinator(max_cohorts=2, max_waiting_ranks=3, max_world_size=64)
    try:
        from concurrent.futures import ThreadPoolExecutor

        from tests.helpers import run_rank

        m = manifest_of()
        with ThreadPoolExecutor(max_workers=3) as pool:
            held = [
                pool.submit(run_rank, c.addr, join_request(f"lim-{i}", 0, 2, m), m, 5.0)
                for i in range(2)
            ]
            import time

            time.sleep(0.5)
            third = run_rank(c.addr, join_request("lim-x", 0, 2, m), m)
            assert third.error is not None
            assert third.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_cohorts=2" in (third.error.details() or "")
            big = run_rank(c.addr, join_request("lim-y", 0, 65, m), m)
            assert big.error is not None
            assert big.error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_world_size=64" in (big.error.details() or "")
            fill = run_rank(c.addr, join_request("lim-0", 1, 2, m), m)
            assert fill.verdict is not None  # completes lim-0: joins are still served
            [f.result(timeout=10) for f in held]
    finally:
        c.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_join_then_cancel_calls_do_not_keep_cohort_slots() -> None:
    """3,000 joins cancelled at once, from 16 threads, each on its own connection, against
    100 slots: a cohort whose every rank left frees its slot, so a new job forms at once."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    c = InProcessCoordinator(max_cohorts=100, join_deadline=60.0, progress_interval=0.2)
    m = manifest_of()

    def join_and_cancel(i: int) -> None:
        with grpc.insecure_channel(c.addr) as channel:
            call = pb_grpc.CohortServiceStub(channel).Join(
                join_request(f"cancelled-{i}", 0, 2, m), timeout=30
            )
            time.sleep(0.002 * (i % 5))
            call.cancel()

    try:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(join_and_cancel, range(3000)))
        started = time.monotonic()
        results = run_cohort(c.addr, "after-the-storm", {0: m, 1: m}, timeout=10)
        took = time.monotonic() - started
        held = c.call(lambda: c.running.coordinator.store.waiting_cohorts)
    finally:
        c.stop()
    assert all(r.verdict is not None for r in results), [r.error for r in results]
    assert held == 0
    print(f"a new job formed {took:.3f}s after 3,000 join-then-cancel calls")


def test_non_loopback_needs_a_flag_and_warns_without_tls_or_tokens(tmp_path: Path) -> None:
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "cohortgate.coordinator.cli",
            "serve",
            "--listen",
            "0.0.0.0:0",
            "--history",
            "off",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert refused.returncode == 2
    assert "not a loopback address; pass --allow-remote" in refused.stderr
    with coordinator_process("--allow-remote", tmp=tmp_path, listen="0.0.0.0:0") as (_, log):
        text = log.read_text()
    assert "serving a non-loopback address without TLS and tokens" in text


@pytest.mark.slow
def test_the_limits_no_other_test_reaches_refuse_naming_themselves() -> None:
    """max_waiting_ranks, max_manifest_entries, and the caps on names, dimensions and
    layout pieces: each refusal names the limit and its value."""
    from concurrent.futures import ThreadPoolExecutor

    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
    from cohortgate.coordinator.codec import wire
    from tests.helpers import run_rank

    c = InProcessCoordinator(max_waiting_ranks=3, max_manifest_entries=10, join_deadline=30.0)
    m = manifest_of()

    def refused(request: pb.JoinRequest) -> grpc.RpcError:
        result = run_rank(c.addr, request, m, 5.0)
        assert result.error is not None, result.verdict
        return result.error

    try:
        with ThreadPoolExecutor(max_workers=3) as pool:
            held = [
                pool.submit(run_rank, c.addr, join_request("wait", r, 4, m), m, 8.0)
                for r in range(3)
            ]
            time.sleep(1.0)
            error = refused(join_request("other", 0, 2, m))
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_waiting_ranks=3" in (error.details() or ""), error.details()
            error = refused(join_request("wait", 3, 4, m, manifest_entries=11))
            assert "max_manifest_entries=10" in (error.details() or ""), error.details()
            for f in held:
                f.result(timeout=20)
        deep = join_request("deep", 0, 1, m)
        deep.layout.CopyFrom(
            pb.Layout(
                pieces=[pb.ShardPiece(tensor="t", shape=[1] * 65, offset=[0] * 65, length=[1] * 65)]
            )
        )
        error = refused(deep)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "65 dimensions; the limit is 64" in (error.details() or ""), error.details()
        many = join_request("many", 0, 1, m)
        many.layout.CopyFrom(
            pb.Layout(
                pieces=[pb.ShardPiece(tensor="t", shape=[1], offset=[0], length=[1])]
                * (wire.MAX_PIECES + 1)
            )
        )
        error = refused(many)
        assert f"the limit is {wire.MAX_PIECES} per rank" in (error.details() or "")
        long_name = pb.UploadManifestRequest(
            job_id="nobody",
            round=1,
            rank=0,
            incarnation="x",
            signature=b"s" * 32,
            manifest=pb.Manifest(
                format=1,
                entries=[
                    pb.ManifestEntry(
                        kind=pb.ManifestEntry.KIND_PARAMETER, name="n" * 1025, dtype="float32"
                    )
                ],
            ),
        )
        from cohortgate.coordinator.contract.errors import LimitExceeded
        from cohortgate.coordinator.edge.rpc import manifest_of as decode

        with pytest.raises(LimitExceeded, match="a name of 1025 characters; the limit is 1024"):
            decode(long_name.SerializeToString())
    finally:
        c.stop()
