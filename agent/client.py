"""The join client: one streaming call per rank, retried with jittered backoff while unavailable."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from cohortgate.agent.reachability import Reachability, say_progress
from cohortgate.agent.torchrun import CohortgateError, RankIdentity
from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.codec.channel import ClientSecurity
from cohortgate.coordinator.codec.leader import Upstream
from cohortgate.coordinator.contract.digests import DIGEST_FORMAT_VERSION, combine
from cohortgate.coordinator.contract.layout import Layout
from cohortgate.coordinator.contract.manifest import Manifest
from cohortgate.coordinator.contract.settings import SettingError, env_seconds

logger = logging.getLogger("cohortgate.agent")

# Codes worth retrying: the coordinator restarted, is shutting down, or is not up yet. A
# call the server cancelled (grpc ends the calls still open when a coordinator stops) is one
# too (this client cancels its own join only when grpc's deadline failed to: Overdue).
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
# Rank 0 reports progress no more often than this.
PROGRESS_EVERY_S = 5.0
# grpc's own deadline was seen not to end a join: a call that stayed open for an hour, its
# deadline long past and no connection left, after the replica it had reached was stopped
# with SIGTERM (1 in ~100 runs of the rolling-update test). A join still open this long past
# its deadline is cancelled by the agent's own timer.
OVERDUE_S = 5.0


class Overdue(Exception):
    """grpc's deadline did not end a call: the agent's timer cancelled it."""


@contextlib.contextmanager
def cancelled_when_overdue(call: grpc.RpcContext, after_s: float) -> Iterator[None]:
    """Cancel `call` `after_s` seconds from now unless the block has ended by then; the
    block's grpc error is then raised as Overdue (not as the CANCELLED of a server that
    stopped, which is retried at once)."""
    fired = threading.Event()

    def overdue() -> None:
        fired.set()
        call.cancel()

    timer = threading.Timer(after_s, overdue)
    timer.daemon = True
    timer.start()
    try:
        yield
    except grpc.RpcError:
        if fired.is_set():
            raise Overdue(f"the call was still open {after_s:g}s after it started") from None
        raise
    finally:
        timer.cancel()


def _timeout_from_env() -> float:
    """COHORTGATE_TIMEOUT, read when a join starts (a bad value is that join's error, named,
    not an import error)."""
    return env_seconds("COHORTGATE_TIMEOUT", DEFAULT_TIMEOUT_S)


# Above the coordinator's default 600 s join deadline; COHORTGATE_TIMEOUT overrides.
DEFAULT_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class JoinOptions:
    timeout_s: float = field(default_factory=_timeout_from_env)
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    # A restarted rank can arrive before the coordinator has noticed its dead predecessor
    # (it drops a dead rank within its grace, 15 s by default): ALREADY_EXISTS is retried
    # this long before it is taken for what it then is, two live processes on one rank.
    held_retry_s: float = 20.0
    # An unreachable coordinator is reported (rank 0 on stderr, the others at debug) once
    # it has failed this long, then this often while the agent keeps retrying.
    unreachable_after_s: float = 3.0
    unreachable_every_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise SettingError(
                f"timeout_s={self.timeout_s:g}: a join needs a positive number of seconds"
            )


def runtime_facts(device_type: str) -> pb.RuntimeFacts:
    import torch

    facts = pb.RuntimeFacts(
        torch_version=str(torch.__version__),
        cuda_version=str(torch.version.cuda or ""),
        device_type=device_type,
    )
    if device_type == "cuda" and torch.cuda.is_available():
        with contextlib.suppress(Exception):  # NCCL absent from this build: leave it empty
            facts.nccl_version = ".".join(str(v) for v in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
        device = torch.cuda.current_device()
        facts.device_name = torch.cuda.get_device_name(device)
        facts.device_capability = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return facts


def join(
    identity: RankIdentity,
    manifest: Manifest,
    *,
    init_method: str,
    runtime: pb.RuntimeFacts,
    options: JoinOptions | None = None,
    on_progress: Callable[[pb.Progress], None] | None = None,
    layout: Layout | None = None,
    digests: Sequence[bytes] | None = None,
    sharded_without_layout: bool = False,
    agreed: Mapping[str, Mapping[str, str]] | None = None,
) -> pb.Verdict:
    """Join the cohort and block until its verdict (FORMED or REFUSED). `digests`: the
    per-tensor weight digests in manifest order (cohortgate.agent.digest), to have values
    checked."""
    opts = options or JoinOptions()
    request = pb.JoinRequest(
        protocol_version=wire.PROTOCOL_VERSION,
        job_id=identity.job_id,
        rank=identity.rank,
        world_size=identity.world_size,
        local_rank=identity.local_rank,
        host=identity.host,
        pid=identity.pid,
        incarnation=identity.incarnation,
        signature=manifest.signature(),
        manifest_entries=len(manifest),
        runtime=runtime,
        init_method=init_method,
        launch=identity.launch,
        restart_count=identity.restart_count,
        elastic=identity.elastic,
        sharded_without_layout=sharded_without_layout,
        # Rank 0 reports progress; the others need only the first event and the verdict.
        quiet=identity.rank != 0 and on_progress is None,
    )
    if layout is not None:
        request.layout.CopyFrom(wire.layout_to_pb(layout))
    _fingerprints(request, agreed or {})
    if digests is not None:
        names = [e.name for e in manifest.entries]
        request.weights_digest = combine(zip(names, digests, strict=True))
        request.weights_digest_format = DIGEST_FORMAT_VERSION
    started = time.monotonic()
    reach = Reachability(identity, started + opts.timeout_s, opts)
    security = ClientSecurity.from_env()
    upstream = reach.upstream = Upstream(identity.addr)
    channels: dict[str, grpc.Channel] = {}

    def stub() -> pb_grpc.CohortServiceStub:
        """The stub for the replica tried now (COHORTGATE_ADDR may list several)."""
        addr = upstream.current
        if addr not in channels:
            channels[addr] = security.channel(addr, options=_channel_options(opts))
        return pb_grpc.CohortServiceStub(channels[addr])

    try:
        return _join_loop(
            stub,
            request,
            identity,
            manifest,
            opts,
            on_progress,
            security,
            digests,
            reach,
            started,
        )
    finally:
        for channel in channels.values():
            channel.close()


def _channel_options(opts: JoinOptions) -> list[tuple[str, int | str]]:
    return [
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Reconnect on our own backoff's schedule, not grpc's (up to 120 s), so a
        # coordinator that comes up is found within seconds.
        ("grpc.initial_reconnect_backoff_ms", int(opts.backoff_initial_s * 1000)),
        ("grpc.min_reconnect_backoff_ms", int(opts.backoff_initial_s * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(opts.backoff_max_s * 1000)),
    ]


def _join_loop(
    stub: Callable[[], pb_grpc.CohortServiceStub],
    request: pb.JoinRequest,
    identity: RankIdentity,
    manifest: Manifest,
    opts: JoinOptions,
    on_progress: Callable[[pb.Progress], None] | None,
    security: ClientSecurity,
    digests: Sequence[bytes] | None,
    reach: Reachability,
    started: float,
) -> pb.Verdict:
    give_up_at = started + opts.timeout_s
    delay = opts.backoff_initial_s
    last_error = ""
    while True:
        remaining = give_up_at - time.monotonic()
        if remaining <= 0:
            if reach.failing_since is not None:
                raise CohortgateError(
                    f"cannot reach the cohortgate coordinator at {identity.addr}: "
                    f"{reach.last} (for {time.monotonic() - reach.failing_since:.0f}s, "
                    f"giving up after {opts.timeout_s:g}s); check that it runs and that "
                    "COHORTGATE_ADDR points at it",
                    grpc.StatusCode.UNAVAILABLE,
                )
            raise CohortgateError(
                f"no verdict from the cohortgate coordinator at {identity.addr} within "
                f"{opts.timeout_s:g}s (last error: {last_error or 'none'}); check its "
                "log and `cohortgate status`"
            )
        try:
            return _stream(
                stub(),
                request,
                identity,
                manifest,
                remaining,
                on_progress,
                security.metadata,
                digests,
                reach,
            )
        except Overdue as exc:
            last_error = f"DEADLINE_EXCEEDED: {exc}; cancelled by the agent"
            continue
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                last_error = f"{code.name}: {details}"
                continue
            held = code is grpc.StatusCode.ALREADY_EXISTS
            if held and time.monotonic() - started < opts.held_retry_s:
                last_error = f"{code.name}: {details}"
            elif code not in RETRYABLE:
                raise CohortgateError(
                    f"the cohortgate coordinator at {identity.addr} refused the join of "
                    f"rank {identity.rank}: {code.name}: {details}" + _too_large(request, details),
                    code,
                ) from None
            else:
                reach.failed(details or code.name)
                wait = reach.upstream.failed(exc) if reach.upstream is not None else None
                if wait is not None:  # another replica to try, or the one that leads
                    last_error = f"{code.name}: {details}"
                    time.sleep(min(wait, max(give_up_at - time.monotonic(), 0)))
                    continue
            last_error = f"{code.name}: {details}"
        # Full jitter: 4,096 ranks reconnecting at once must not arrive in lockstep.
        time.sleep(min(random.uniform(0, delay), max(give_up_at - time.monotonic(), 0)))
        delay = min(delay * 2, opts.backoff_max_s)


def _fingerprints(request: pb.JoinRequest, agreed: Mapping[str, Mapping[str, str]]) -> None:
    """The config, code and facts fingerprints into the join (sent, even when empty)."""
    for name, fields in agreed.items():
        getattr(request, name).SetInParent()
        getattr(request, name).fields.update(fields)


def _too_large(request: pb.JoinRequest, details: str) -> str:
    """What to do when the join itself is over the coordinator's message limit."""
    if "larger than max" not in details:
        return ""
    pieces = len(request.layout.pieces) + len(request.layout.columns.replicated)
    return (
        f" (this join is {request.ByteSize()} bytes, with a layout of {pieces} pieces); raise "
        "the coordinator's --max-message-bytes, and a relay's, to take it"
    )


def _answer(
    rpc: Callable[..., object],
    request: pb.UploadManifestRequest | pb.UploadDigestsRequest,
    what: str,
    identity: RankIdentity,
    timeout: float,
    metadata: Sequence[tuple[str, str]],
) -> None:
    """Answer a manifest or digest request, in chunks (a manifest can be larger than one
    message may be). A refused upload is not the end: the coordinator refuses the whole
    cohort for it, and this rank waits on its join to receive that verdict too."""
    try:
        rpc(wire.upload_chunks(request), timeout=min(timeout, 60.0), metadata=metadata)
    except grpc.RpcError as exc:
        if exc.code() in RETRYABLE:
            raise  # the join is retried and the coordinator asks again
        say_progress(f"rank {identity.rank}: the coordinator refused our {what}: {exc.details()}")


def _answer_files(
    stub: pb_grpc.CohortServiceStub,
    join: pb.JoinRequest,
    round_: int,
    identity: RankIdentity,
    metadata: Sequence[tuple[str, str]],
) -> None:
    """The local code files this rank's join fingerprinted
    (cohortgate.agent.identity.LOCAL_FILES)."""
    from cohortgate.agent.identity import LOCAL_FILES

    upload = pb.UploadFilesRequest(
        job_id=join.job_id,
        round=round_,
        rank=join.rank,
        incarnation=join.incarnation,
        paths=[p for p, _ in LOCAL_FILES],
        digests=[d for _, d in LOCAL_FILES],
    )
    try:
        stub.UploadFiles(upload, timeout=30.0, metadata=metadata)
    except grpc.RpcError as exc:
        if exc.code() in RETRYABLE:
            raise
        say_progress(
            f"rank {identity.rank}: the coordinator refused our code files: {exc.details()}"
        )


def _stream(
    stub: pb_grpc.CohortServiceStub,
    request: pb.JoinRequest,
    identity: RankIdentity,
    manifest: Manifest,
    timeout: float,
    on_progress: Callable[[pb.Progress], None] | None,
    metadata: Sequence[tuple[str, str]] = (),
    digests: Sequence[bytes] | None = None,
    reach: Reachability | None = None,
) -> pb.Verdict:
    # Not wait_for_ready: an unreachable coordinator must fail the call at once, so that
    # the loop above can say so and retry, instead of blocking silently until the deadline.
    call = stub.Join(request, timeout=timeout, metadata=metadata)
    last_said = float("-inf")
    with cancelled_when_overdue(call, timeout + OVERDUE_S):
        for event in call:
            if reach is not None:
                reach.reached()
                reach = None
            kind = event.WhichOneof("event")
            if kind == "verdict":
                verdict: pb.Verdict = event.verdict
                return verdict
            if kind == "manifest_request":
                upload = wire.manifest_answer(request, event.manifest_request.round, manifest)
                _answer(stub.UploadManifestChunks, upload, "manifest", identity, timeout, metadata)
            elif kind == "digest_request" and event.digest_request.files:
                # this rank's local code differs from another rank's: name the files
                _answer_files(stub, request, event.digest_request.round, identity, metadata)
            elif kind == "digest_request":
                # this rank's weights differ from another replica's: name the tensors
                answer = wire.digests_answer(request, event.digest_request.round, digests or ())
                _answer(stub.UploadDigestsChunks, answer, "digests", identity, timeout, metadata)
            elif kind == "progress":
                progress = event.progress
                request.round = progress.round  # a reconnect re-joins this round, not a new one
                if on_progress is not None:
                    on_progress(progress)
                now = time.monotonic()
                if identity.rank == 0 and now - last_said >= PROGRESS_EVERY_S:
                    last_said = now
                    say_progress(
                        f"job {progress.job_id} round {progress.round}: {progress.message}"
                    )
        raise CohortgateError(
            f"the cohortgate coordinator at {identity.addr} ended the join of rank "
            f"{identity.rank} without a verdict"
        )
