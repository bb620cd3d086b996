"""A relay's audits: its ranks' `cohort.audit()` calls, sent upstream as one Audit call per
node and step (batched until `local_ranks` audits are in, or WINDOW_S after the first), each
rank answered with its own cohort's answer. An upstream error is every waiting rank's
error, passed back as it came (the agent says it once and trains on)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from coordinator.api.v1 import cohort_pb2 as pb

# A node's ranks audit the same step within milliseconds of each other (DDP keeps them in
# step): long enough to batch them, short enough that a rank that never comes costs nothing.
WINDOW_S = 0.05
UPSTREAM_TIMEOUT_S = 10.0

Metadata = Sequence[tuple[str, str]]
Send = Callable[[pb.AuditRequest, Metadata], Awaitable[pb.AuditReply]]


@dataclass
class _Batch:
    metadata: Metadata = ()
    audits: list[pb.RankAudit] = field(default_factory=list)
    done: asyncio.Future[pb.AuditReply] | None = None
    timer: asyncio.TimerHandle | None = None


class RelayAudits:
    def __init__(self, send: Send, local_ranks: int, window_s: float = WINDOW_S) -> None:
        self.send, self.local_ranks, self.window_s = send, local_ranks, window_s
        self._open: dict[tuple[str, tuple[tuple[str, str], ...]], _Batch] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def audit(self, request: pb.AuditRequest, metadata: Metadata) -> pb.AuditReply:
        """The answers for the cohorts `request` names, once its batch went upstream."""
        if not request.audits:  # the coordinator's error, without a trip upstream
            return await self.send(request, metadata)
        key = (request.audits[0].job_id, tuple(metadata))
        batch = self._open.get(key)
        loop = asyncio.get_running_loop()
        if batch is None:
            batch = self._open[key] = _Batch(metadata, done=loop.create_future())
            batch.timer = loop.call_later(self.window_s, self._flush, key, batch)
        batch.audits.extend(request.audits)
        assert batch.done is not None
        done = batch.done
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
        assert batch.done is not None
        try:
            reply = await self.send(pb.AuditRequest(audits=batch.audits), batch.metadata)
        except BaseException as exc:  # grpc's error (or a cancel): every waiting rank's
            if not batch.done.done():
                batch.done.set_exception(exc)
            batch.done.exception()  # retrieved: no "never retrieved" warning
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        batch.done.set_result(reply)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
