"""A relay's audits: its ranks' `cohort.audit()` calls, sent upstream as one Audit call per
node and step (batched until `local_ranks` audits are in, or WINDOW_S after the first), each
rank answered with its own cohort's answer. An upstream error is every waiting rank's
error, passed back as it came (the agent says it once and trains on), except one that
names a bad request: then each rank's request is sent again alone, so that one rank's bad
audit is that rank's error only."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.contract.limits import MAX_AUDITS_PER_CALL

# A node's ranks audit the same step within milliseconds of each other (DDP keeps them in
# step): long enough to batch them, short enough that a rank that never comes costs nothing.
WINDOW_S = 0.05
UPSTREAM_TIMEOUT_S = 10.0
# The upstream's answer to a batch that one request in it spoiled (an invalid audit, one too
# large): each request goes again on its own. Any other error (unreachable, unauthenticated,
# a standby) is every rank's alike.
_A_REQUESTS_FAULT = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)

Metadata = Sequence[tuple[str, str]]
Send = Callable[[pb.AuditRequest, Metadata], Awaitable[pb.AuditReply]]


@dataclass
class _Batch:
    metadata: Metadata = ()
    audits: list[pb.RankAudit] = field(default_factory=list)
    # Each rank's request in it: (its first audit's index, its audit count, its answer).
    parts: list[tuple[int, int, asyncio.Future[pb.AuditReply]]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


class RelayAudits:
    def __init__(self, send: Send, local_ranks: int, window_s: float = WINDOW_S) -> None:
        self.send, self.local_ranks, self.window_s = send, local_ranks, window_s
        self._open: dict[tuple[str, tuple[tuple[str, str], ...]], _Batch] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def audit(self, request: pb.AuditRequest, metadata: Metadata) -> pb.AuditReply:
        """The answers for the cohorts `request` names, once its batch went upstream."""
        if _alone(request):  # the coordinator's answer to it, not shared with a batch
            return await self.send(request, metadata)
        key = (request.audits[0].job_id, tuple(metadata))
        batch = self._open.get(key)
        if batch is not None and len(batch.audits) + len(request.audits) > MAX_AUDITS_PER_CALL:
            self._flush(key, batch)  # one call upstream stays within the coordinator's limit
            batch = None
        loop = asyncio.get_running_loop()
        if batch is None:
            batch = self._open[key] = _Batch(metadata)
            batch.timer = loop.call_later(self.window_s, self._flush, key, batch)
        done: asyncio.Future[pb.AuditReply] = loop.create_future()
        batch.parts.append((len(batch.audits), len(request.audits), done))
        batch.audits.extend(request.audits)
        if len(batch.audits) >= self.local_ranks:
            self._flush(key, batch)
        reply = await asyncio.shield(done)
        mine = {a.cohort_id for a in request.audits}
        return pb.AuditReply(answers=[a for a in reply.answers if a.cohort_id in mine])

    def _flush(self, key: tuple[str, tuple[tuple[str, str], ...]], batch: _Batch) -> None:
        if self._open.get(key) is not batch:
            return  # flushed already
        del self._open[key]
        if batch.timer is not None:
            batch.timer.cancel()
        task = asyncio.get_running_loop().create_task(self._send(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: _Batch) -> None:
        try:
            reply = await self.send(pb.AuditRequest(audits=batch.audits), batch.metadata)
        except grpc.aio.AioRpcError as exc:
            if len(batch.parts) > 1 and exc.code() in _A_REQUESTS_FAULT:
                await asyncio.gather(*(self._send_alone(batch, part) for part in batch.parts))
            else:
                _fail(batch, exc)
            return
        except BaseException as exc:  # a cancel, or a bug: every waiting rank's
            _fail(batch, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for _, _, done in batch.parts:
            if not done.done():
                done.set_result(reply)

    async def _send_alone(
        self, batch: _Batch, part: tuple[int, int, asyncio.Future[pb.AuditReply]]
    ) -> None:
        first, count, done = part
        request = pb.AuditRequest(audits=batch.audits[first : first + count])
        try:
            reply = await self.send(request, batch.metadata)
        except BaseException as exc:
            _settle(done, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if not done.done():
            done.set_result(reply)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()


def _alone(request: pb.AuditRequest) -> bool:
    """Sent upstream on its own: an empty request or one of several jobs (the coordinator
    says what is wrong with it), one over the limit, or per-tensor digests (up to a few MB:
    two in one batch could pass the message limit; they are asked of few ranks)."""
    audits = request.audits
    return (
        not audits
        or len(audits) > MAX_AUDITS_PER_CALL
        or any(a.tensor_names or a.tensor_digests for a in audits)
        or any(a.job_id != audits[0].job_id for a in audits)
    )


def _fail(batch: _Batch, exc: BaseException) -> None:
    for _, _, done in batch.parts:
        _settle(done, exc)


def _settle(done: asyncio.Future[pb.AuditReply], exc: BaseException) -> None:
    if not done.done():
        done.set_exception(exc)
    done.exception()  # retrieved: no "never retrieved" warning when its rank has gone
