"""The status service's handlers: what is held, watched and recorded, to the token's scope
(a job token sees its job only; an admin token, or no auth, sees all)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.contract.errors import InvalidArgument, NotFound
from cohortgate.coordinator.edge import replies
from cohortgate.coordinator.edge.auth import Auth
from cohortgate.coordinator.edge.servicer import answering, metadata_of
from cohortgate.coordinator.service.core import Coordinator
from cohortgate.coordinator.service.status import CohortSummary


class StatusServicer(pb_grpc.StatusServiceServicer):
    """Status reads: a job token sees its job only; an admin token (or no auth) sees all."""

    def __init__(self, coordinator: Coordinator, auth: Auth | None = None) -> None:
        self.coordinator = coordinator
        self.auth = auth or Auth(None)
        self._listed: tuple[list[CohortSummary] | None, bytes] = (None, b"")
        self._encodings: dict[int, tuple[CohortSummary, bytes]] = {}

    async def _scope(
        self, context: grpc.aio.ServicerContext, method: str, job_id: str
    ) -> tuple[str, str]:
        """The job filter to apply (the one asked for, or the token's own job), and who
        asks (the token's scope)."""
        async with answering(self.coordinator, context, method):
            grant = self.auth.grant(metadata_of(context))
            if job_id:
                if not grant.allows(job_id):
                    self.auth.check_job(metadata_of(context), job_id)
                return job_id, grant.scope
            return ("" if grant.admin else grant.scope), grant.scope
        raise AssertionError("unreachable")  # answering aborts the call

    async def ListCohorts(  # type: ignore[override]  # encoded once, sent as bytes
        self, request: pb.ListCohortsRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        job_id, _ = await self._scope(context, "ListCohorts", request.job_id)
        summaries = self.coordinator.summaries(job_id)
        if self._listed[0] is not summaries:  # a large listing is reused for 0.25 s
            response = pb.ListCohortsResponse(cohorts=[replies.summary_to_pb(s) for s in summaries])
            self._listed = (summaries, response.SerializeToString())
        return self._listed[1]

    def _encoded(self, summary: CohortSummary) -> bytes:
        """A watch tick hands the same summary to every watcher of its job: encoded once."""
        hit = self._encodings.get(id(summary))
        if hit is not None and hit[0] is summary:
            return hit[1]
        if len(self._encodings) >= 4096:
            self._encodings.clear()
        data = replies.summary_to_pb(summary).SerializeToString()
        self._encodings[id(summary)] = (summary, data)
        return data

    async def GetCohort(
        self, request: pb.GetCohortRequest, context: grpc.aio.ServicerContext
    ) -> pb.CohortDetail:
        job_id, _ = await self._scope(context, "GetCohort", request.job_id)
        async with answering(self.coordinator, context, "GetCohort", job_id):
            cohort = self.coordinator.find(job_id, request.round) if job_id else None
            if cohort is None:
                what = f"round {request.round} of job" if request.round else "job"
                raise NotFound(f"no {what} '{request.job_id[:64]}' is held by this coordinator")
            summary = next(
                s for s in self.coordinator.summaries(cohort.job_id) if s.round == cohort.round
            )
            return replies.detail_to_pb(summary, cohort)
        raise AssertionError("unreachable")  # answering aborts the call

    async def WatchCohorts(  # type: ignore[override]  # encoded once per tick, sent as bytes
        self, request: pb.WatchCohortsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        job_id, holder = await self._scope(context, "WatchCohorts", request.job_id)
        async with answering(self.coordinator, context, "WatchCohorts", job_id):
            async for summary in self.coordinator.watch(job_id, holder):
                yield self._encoded(summary)

    async def ListAudits(
        self, request: pb.ListAuditsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAuditsResponse:
        job_id, _ = await self._scope(context, "ListAudits", request.job_id)
        async with answering(self.coordinator, context, "ListAudits", job_id):
            if not job_id:
                raise InvalidArgument("ListAudits needs a job_id")
            found = self.coordinator.audits.findings(job_id)
            return pb.ListAuditsResponse(audits=[replies.finding_to_pb(f) for f in found])
        raise AssertionError("unreachable")  # answering aborts the call

    async def GetVerdict(
        self, request: pb.GetVerdictRequest, context: grpc.aio.ServicerContext
    ) -> pb.VerdictRecord:
        job_id, _ = await self._scope(context, "GetVerdict", request.job_id)
        history = self.coordinator.history
        async with answering(self.coordinator, context, "GetVerdict", job_id):
            row = history.get(job_id, request.round) if job_id else None
            if row is None:
                what = f"round {request.round} of job" if request.round else "job"
                raise NotFound(f"no verdict for {what} '{request.job_id[:64]}' in the history")
            return replies.record_to_pb(row)
        raise AssertionError("unreachable")  # answering aborts the call
