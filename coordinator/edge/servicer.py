"""Thin gRPC handlers: proto in, domain call, domain error to status code out."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

import grpc
import structlog
from google.protobuf.message import Message

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec.leader import LEADER_KEY
from cohortgate.coordinator.codec.wire import sha256
from cohortgate.coordinator.contract.errors import (
    AlreadyHeld,
    CoordinatorError,
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    NotLeader,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.decision.cohort import UploadKind
from cohortgate.coordinator.edge import joins, replies, rpc
from cohortgate.coordinator.edge.auth import Auth
from cohortgate.coordinator.service.core import Coordinator
from cohortgate.coordinator.state.base import JoinIntent

log = structlog.get_logger("cohortgate")

DECODES = 2
_DECODERS: ProcessPoolExecutor | None = None


def _decoders() -> ProcessPoolExecutor:
    """Processes that decode large manifests (spawned: the server's threads are not copied;
    started at the first large upload)."""
    global _DECODERS  # noqa: PLW0603 (one pool per process, made on first use)
    if _DECODERS is None:
        _DECODERS = ProcessPoolExecutor(max_workers=DECODES, mp_context=mp.get_context("spawn"))
    return _DECODERS


_T = TypeVar("_T")
# Requests up to this size are decoded on the loop (a join without a big layout: ~1 KB).
INLINE_DECODE_BYTES = 64 * 1024

# The one place domain errors become status codes.
STATUS_CODES: dict[type[CoordinatorError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    AlreadyHeld: grpc.StatusCode.ALREADY_EXISTS,
    NotFound: grpc.StatusCode.NOT_FOUND,
    LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_code(exc: CoordinatorError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.UNKNOWN


class QuietRefusals:
    """A standby refuses every join of every rank, again every half second, while no replica
    leads or the ranks follow the leader: one log line per job and EVERY_S, saying how many
    it stands for (cohortgate_rpc_errors_total{code="UNAVAILABLE"} counts each)."""

    EVERY_S = 30.0
    KEPT = 10_000  # jobs remembered at once (past it, those said longest ago are forgotten)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._said: dict[str, tuple[float, int]] = {}  # job -> (said at, refused since)

    def due(self, job: str) -> int | None:
        """The refusals this line stands for (this one included), or None: not now."""
        now = self.clock()
        said = self._said.get(job)
        if said is not None and now - said[0] < self.EVERY_S:
            self._said[job] = (said[0], said[1] + 1)
            return None
        if len(self._said) >= self.KEPT:
            oldest = sorted(self._said, key=lambda k: self._said[k][0])[: self.KEPT // 2]
            for key in oldest:
                del self._said[key]
        self._said[job] = (now, 0)
        return 1 + (said[1] if said is not None else 0)


STANDBY_REFUSALS = QuietRefusals()


async def _abort(
    coordinator: Coordinator,
    context: grpc.aio.ServicerContext,
    method: str,
    exc: CoordinatorError,
) -> None:
    code = status_code(exc)
    coordinator.observer.rpc_error(method, code.name)
    if isinstance(exc, NotLeader):
        job = str(structlog.contextvars.get_contextvars().get("job", ""))
        refused = STANDBY_REFUSALS.due(job)
        if refused is not None:
            log.info(
                "standing by: joins refused",
                method=method,
                refused=refused,
                every_s=QuietRefusals.EVERY_S,
                error=str(exc),
            )
    else:
        log.info("rpc refused", method=method, code=code.name, error=str(exc))
    if isinstance(exc, NotLeader) and exc.leader:  # the agent follows it at once
        await context.abort(code, str(exc), trailing_metadata=((LEADER_KEY, exc.leader),))
    await context.abort(code, str(exc))


async def _internal(
    coordinator: Coordinator, context: grpc.aio.ServicerContext, method: str, exc: Exception
) -> None:
    """A bug, not a bad request: log it whole, answer INTERNAL, keep serving."""
    if isinstance(exc, asyncio.CancelledError | grpc.aio.AbortError):
        raise exc
    coordinator.observer.rpc_error(method, "INTERNAL")
    log.exception("internal error", method=method)
    await context.abort(
        grpc.StatusCode.INTERNAL,
        f"internal error in the coordinator ({type(exc).__name__}: {exc}); its log has the "
        "traceback. Please report it.",
    )


@contextlib.asynccontextmanager
async def answering(
    coordinator: Coordinator,
    context: grpc.aio.ServicerContext,
    method: str,
    job_id: str = "",
    **log_context: int,
) -> AsyncIterator[None]:
    """A call's log context, and its errors as status codes (a bug as INTERNAL)."""
    with structlog.contextvars.bound_contextvars(job=job_id[:64], **log_context):
        try:
            yield
        except CoordinatorError as exc:
            await _abort(coordinator, context, method, exc)
        except Exception as exc:
            await _internal(coordinator, context, method, exc)


def metadata_of(context: grpc.aio.ServicerContext) -> list[tuple[str, str | bytes]]:
    return [(m.key, m.value) for m in context.invocation_metadata() or ()]


class CohortServicer(pb_grpc.CohortServiceServicer):
    def __init__(
        self,
        coordinator: Coordinator,
        auth: Auth | None = None,
        limits: Limits | None = None,
        rank_grace_s: float = 15.0,
    ) -> None:
        self.coordinator = coordinator
        self.auth = auth or Auth(None)
        self.limits = limits or Limits()
        self.rank_grace_s = rank_grace_s
        # Large requests decoded at once, off the loop (see _decoded): more would only
        # queue for the GIL or a worker while holding their payloads in memory.
        self._decoding = asyncio.Semaphore(DECODES)

    def Join(  # type: ignore[override]  # bytes in (RAW_JOINS), pre-encoded verdicts out
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JoinEvent | bytes]:
        return self._join(context, "Join", data)

    def JoinGroup(  # type: ignore[override]  # bytes in (RAW_JOINS), pre-encoded verdicts out
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JoinEvent | bytes]:
        return self._join(context, "JoinGroup", data)

    async def JoinPoll(  # type: ignore[override]  # bytes in (RAW_JOINS), pre-encoded out
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> pb.JoinEvent | bytes:
        """JoinGroup as a long poll: the group's first event (see Admission.poll)."""
        async with answering(self.coordinator, context, "JoinPoll"):
            intents = await self._admitted(context, "JoinPoll", data)
            event = await self.coordinator.poll(
                intents,
                alive=lambda: not context.done(),
                on_gone=lambda wake: context.add_done_callback(lambda _: wake()),
            )
            return replies.event_to_pb(event)
        raise AssertionError("unreachable")  # answering aborts the call

    async def _admitted(
        self, context: grpc.aio.ServicerContext, method: str, data: bytes
    ) -> list[JoinIntent]:
        """A join's intents, validated, with the call's log context, authorised."""
        job_id, intents = await self._intents(method, data)
        structlog.contextvars.bind_contextvars(job=job_id[:64])
        if method == "Join":
            structlog.contextvars.bind_contextvars(rank=intents[0].member.rank)
        else:
            structlog.contextvars.bind_contextvars(group=len(intents))
        self.auth.check_job(metadata_of(context), job_id)
        return intents

    async def _intents(self, method: str, data: bytes) -> tuple[str, list[JoinIntent]]:
        decode = joins.join_intents if method == "Join" else joins.group_join_intents
        return await self._decoded(decode, data)

    async def _decoded(
        self, decode: Callable[[bytes, Limits], _T], data: bytes, *, process: bool = False
    ) -> _T:
        """A request decoded and validated: inline when small (nearly every call), else off
        the loop, two at a time: in a worker thread (a 100k-piece layout, which the cohort
        keeps anyway), or with `process` in a worker process, so that the objects a 1M-entry
        manifest decodes into never touch this process's heap (only its compact form comes
        back)."""
        if len(data) <= INLINE_DECODE_BYTES:
            return decode(data, self.limits)
        async with self._decoding:
            if process:
                loop = asyncio.get_running_loop()
                return await loop.run_in_executor(_decoders(), decode, data, self.limits)
            return await asyncio.to_thread(decode, data, self.limits)

    async def _join(
        self, context: grpc.aio.ServicerContext, method: str, data: bytes
    ) -> AsyncIterator[pb.JoinEvent | bytes]:
        """One rank's join, or a relay's group: validation, auth, then the events."""
        async with answering(self.coordinator, context, method):
            intents = await self._admitted(context, method, data)
            events = self.coordinator.join_group(
                intents,
                alive=lambda: not context.done(),
                on_gone=lambda wake: context.add_done_callback(lambda _: wake()),
            )
            async for event in events:
                yield replies.event_to_pb(event)

    async def UploadManifest(  # type: ignore[override]  # raw bytes: see RAW_REQUESTS
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> pb.UploadManifestResponse:
        async with answering(self.coordinator, context, "UploadManifest"):
            await self._manifest(context, Upload.whole(data))
        return pb.UploadManifestResponse()

    async def UploadManifestChunks(
        self, chunks: AsyncIterator[pb.UploadChunk], context: grpc.aio.ServicerContext
    ) -> pb.UploadManifestResponse:
        async with answering(self.coordinator, context, "UploadManifestChunks"):
            await self._manifest(context, await Upload.chunked(chunks, self.limits))
        return pb.UploadManifestResponse()

    async def UploadDigests(  # type: ignore[override]  # raw bytes: see RAW_REQUESTS
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> pb.UploadDigestsResponse:
        async with answering(self.coordinator, context, "UploadDigests"):
            await self._digests(context, Upload.whole(data))
        return pb.UploadDigestsResponse()

    async def UploadFiles(
        self, request: pb.UploadFilesRequest, context: grpc.aio.ServicerContext
    ) -> pb.UploadFilesResponse:
        """A rank's local code files, asked for when ranks' code differs (small: at most
        MAX_FILES paths, one message)."""
        async with answering(self.coordinator, context, "UploadFiles"):
            ref, files = rpc.files_of(request)
            structlog.contextvars.bind_contextvars(job=ref.job_id[:64], rank=ref.rank)
            self.auth.check_job(metadata_of(context), ref.job_id)
            self.coordinator.upload_files(ref, files)
        return pb.UploadFilesResponse()

    async def UploadDigestsChunks(
        self, chunks: AsyncIterator[pb.UploadChunk], context: grpc.aio.ServicerContext
    ) -> pb.UploadDigestsResponse:
        async with answering(self.coordinator, context, "UploadDigestsChunks"):
            await self._digests(context, await Upload.chunked(chunks, self.limits))
        return pb.UploadDigestsResponse()

    def _sender(
        self, context: grpc.aio.ServicerContext, upload: Upload, sent: type[Message]
    ) -> pb.UploadManifestHeader:
        """Who an upload says it comes from (its front fields), in the log context, and
        allowed by the caller's token."""
        head = rpc.upload_header(upload.front, sent)
        structlog.contextvars.bind_contextvars(job=head.job_id[:64], rank=head.rank)
        self.auth.check_job(metadata_of(context), head.job_id)
        return head

    async def _manifest(self, context: grpc.aio.ServicerContext, upload: Upload) -> None:
        """Who sends, and whether the size is allowed, from the request's first fields;
        only then is the rest received, and the manifest decoded, hashed and compacted
        (see _decoded)."""
        head = self._sender(context, upload, pb.UploadManifestRequest)
        ref, signature = rpc.upload_ref(head), sha256(head.signature, "signature")
        if self.coordinator.wants_upload(ref, UploadKind.MANIFEST, signature, upload.size):
            data = await upload.rest()
            manifest = await self._decoded(rpc.manifest_of, data, process=True)
            self.coordinator.upload(ref, manifest, signature, size=len(data))

    async def Audit(
        self, request: pb.AuditRequest, context: grpc.aio.ServicerContext
    ) -> pb.AuditReply:
        """Rank audits during training: validated, authorised, answered at once."""
        async with answering(self.coordinator, context, "Audit"):
            audits, beats = rpc.audits_of(request, self.limits)
            structlog.contextvars.bind_contextvars(job=beats[0].job_id[:64])
            self.auth.check_job(metadata_of(context), beats[0].job_id)
            answers = self.coordinator.audit(audits, beats)
            return pb.AuditReply(answers=[replies.answer_to_pb(a) for a in answers])
        raise AssertionError("unreachable")  # answering aborts the call

    async def Settings(
        self, request: pb.SettingsRequest, context: grpc.aio.ServicerContext
    ) -> pb.SettingsReply:
        """What governs the tree below: relays started without --rank-grace take this one."""
        return pb.SettingsReply(rank_grace_s=self.rank_grace_s)

    async def _digests(self, context: grpc.aio.ServicerContext, upload: Upload) -> None:
        ref = rpc.upload_ref(self._sender(context, upload, pb.UploadDigestsRequest))
        if self.coordinator.wants_upload(ref, UploadKind.DIGESTS, b"", upload.size):
            digests = await self._decoded(rpc.digests_of, await upload.rest())
            await self.coordinator.upload_digests(ref, digests)


class Upload:
    """An upload's bytes as they arrive. `front` (the whole request, or its first chunk)
    names the sender and `size` the whole; the rest of a chunked upload is received only
    when `rest()` is awaited, after the coordinator has decided that it wants it: a
    non-member's stream ends at its first chunk."""

    def __init__(
        self, front: bytes, size: int, more: AsyncIterator[pb.UploadChunk] | None = None
    ) -> None:
        self.front, self.size, self._more = front, size, more

    @classmethod
    def whole(cls, data: bytes) -> Upload:
        return cls(data, len(data))

    @classmethod
    async def chunked(cls, chunks: AsyncIterator[pb.UploadChunk], limits: Limits) -> Upload:
        first = await anext(chunks, None)
        if first is None:
            raise InvalidArgument("the upload stream ended before its first chunk")
        size = first.total_bytes
        if size > limits.max_upload_bytes:
            raise LimitExceeded(
                f"the upload declares {size} bytes; the limit is "
                f"max_upload_bytes={limits.max_upload_bytes} (--max-upload-bytes)"
            )
        if len(first.data) > size:
            raise InvalidArgument(
                f"the first chunk holds {len(first.data)} bytes, more than the {size} bytes it "
                "declares for the whole upload (UploadChunk.total_bytes)"
            )
        return cls(bytes(first.data), size, chunks)

    async def rest(self) -> bytes:
        if self._more is None:
            return self.front
        parts, received = [self.front], len(self.front)
        async for chunk in self._more:
            received += len(chunk.data)
            if received > self.size:
                raise InvalidArgument(
                    f"the upload sent more than the {self.size} bytes its first chunk declared"
                )
            parts.append(chunk.data)
        if received < self.size:
            raise InvalidArgument(
                f"the upload ended after {received} of the {self.size} bytes its first chunk "
                "declared"
            )
        if received <= INLINE_DECODE_BYTES:
            return b"".join(parts)
        return await asyncio.to_thread(b"".join, parts)  # copies without the GIL
