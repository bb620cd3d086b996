"""Thin gRPC handlers: proto in, domain call, domain error to status code out."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog

from coordinator import wire
from coordinator.api.v1 import cohort_pb2 as pb
from coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from coordinator.errors import (
    AlreadyHeld,
    CohortgateError,
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
    NotFound,
    Unauthenticated,
    Unavailable,
)
from coordinator.report import Verdict
from coordinator.service import Coordinator, ManifestAsk, Progress

log = structlog.get_logger("cohortgate")

# The one place domain errors become status codes.
STATUS_CODES: dict[type[CohortgateError], grpc.StatusCode] = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    AlreadyHeld: grpc.StatusCode.ALREADY_EXISTS,
    NotFound: grpc.StatusCode.NOT_FOUND,
    LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
}


def status_code(exc: CohortgateError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.UNKNOWN


def _event(event: Progress | ManifestAsk | Verdict) -> pb.JoinEvent:
    if isinstance(event, Verdict):
        return pb.JoinEvent(verdict=wire.verdict_to_pb(event))
    if isinstance(event, ManifestAsk):
        return pb.JoinEvent(
            manifest_request=pb.ManifestRequest(
                signature=event.signature, job_id=event.job_id, round=event.round
            )
        )
    return pb.JoinEvent(
        progress=pb.Progress(
            job_id=event.job_id,
            round=event.round,
            joined=event.joined,
            expected=event.expected,
            missing_ranks=event.missing_ranks,
            message=event.message,
            deadline_in_seconds=event.deadline_in_s,
        )
    )


class CohortServicer(pb_grpc.CohortServiceServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    async def Join(
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JoinEvent]:
        try:
            intent = wire.join_intent(request)
            async for event in self.coordinator.join(intent):
                yield _event(event)
        except CohortgateError as exc:
            log.info(
                "join refused",
                job=request.job_id[:64],
                rank=request.rank,
                code=status_code(exc).name,
                error=str(exc),
            )
            await context.abort(status_code(exc), str(exc))

    async def UploadManifest(
        self, request: pb.UploadManifestRequest, context: grpc.aio.ServicerContext
    ) -> pb.UploadManifestResponse:
        try:
            if len(request.signature) != 32:
                raise InvalidArgument(
                    f"signature is {len(request.signature)} bytes; a SHA-256 signature is 32"
                )
            manifest = wire.manifest_from_pb(request.manifest)
            self.coordinator.upload(
                request.job_id,
                request.round,
                request.rank,
                request.incarnation,
                manifest,
                bytes(request.signature),
            )
        except CohortgateError as exc:
            log.info(
                "manifest refused",
                job=request.job_id[:64],
                rank=request.rank,
                code=status_code(exc).name,
                error=str(exc),
            )
            await context.abort(status_code(exc), str(exc))
        return pb.UploadManifestResponse()
