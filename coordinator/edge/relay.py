"""`cohortgate relay`: one per node. The node's ranks join here, as they would join the
coordinator (same CohortService); the relay joins them upstream as one JoinGroup call and
hands every rank the coordinator's events. The coordinator then holds one call, one wake-up
and one verdict message per node instead of one per rank.

Relays also take JoinGroup calls from relays below them: a rack relay (its --local-ranks
counting every rank below it) joins its nodes' groups upstream as one call, so the
coordinator's per-call cost is paid once per rack. Each lower relay gets its group's events
once (progress unfiltered: it filters per rank).

Semantics the ranks see are the coordinator's: the same verdict, progress (the first event
always, the rest only to ranks that are not quiet), manifest requests to the rank named,
and the upstream status code when the coordinator refuses the group. A rank that leaves
before the verdict makes the relay re-join the rest of its group without it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import structlog

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec.channel import ClientSecurity
from cohortgate.coordinator.codec.groups import members_of
from cohortgate.coordinator.codec.leader import Upstream
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.edge.plumbing import (
    RAW_CHUNKS,
    keepalive_client_options,
)
from cohortgate.coordinator.edge.relay_audits import UPSTREAM_TIMEOUT_S as AUDIT_TIMEOUT_S
from cohortgate.coordinator.edge.relay_audits import WINDOW_S as AUDIT_WINDOW_S
from cohortgate.coordinator.edge.relay_audits import RelayAudits
from cohortgate.coordinator.edge.relay_parts import (
    GONE,
    REGROUP_S,
    Group,
    GroupFormats,
    GroupKey,
    Outage,
    Rank,
    Status,
    auth_of,
    forwarding,
)

log = structlog.get_logger("cohortgate.relay")


class Relay(pb_grpc.CohortServiceServicer):
    """Batches joins per (job, world size, round, token) until the node's `local_ranks` have
    joined (counting those already sent upstream, so a late or restarted rank goes at once),
    or `window_s` after the first, then joins them upstream as one group. The window never
    delays a formation that waits for a rank of this node anyway; it only bounds how long
    the others wait for a local rank that may never come."""

    def __init__(
        self,
        upstream: str,
        security: ClientSecurity | None = None,
        *,
        window_s: float = 2.0,
        audit_window_s: float = AUDIT_WINDOW_S,
        local_ranks: int = 8,
        max_message_bytes: int = Limits.max_message_bytes,
        rank_grace_s: float = 15.0,
        poll: bool = False,
    ) -> None:
        # The coordinator, or its replicas (a:7070,b:7070): the one that leads is followed.
        self.upstreams = Upstream(upstream, "--upstream")
        # A group goes upstream as one message: it is cut before it grows past this.
        self.max_message_bytes = max_message_bytes
        self._security = security or ClientSecurity()
        # What this relay's server drops a frozen rank within (relay_server.py may adopt the
        # upstream's); its upstream keepalive keeps the grace it started with.
        self.rank_grace_s = self._rank_grace_s = rank_grace_s
        self.told_grace = rank_grace_s  # the upstream's, last time it was asked
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._connect()
        # JoinPoll upstream (--upstream-rpc poll), until the upstream answers UNIMPLEMENTED
        self.polling = poll
        self.formats = GroupFormats()  # how each upstream takes a group
        self.window_s = window_s
        self.local_ranks = local_ranks
        self._pending: dict[GroupKey, Group] = {}
        self._sent: dict[GroupKey, int] = {}  # ranks sent upstream per key, until a verdict
        self._tasks: set[asyncio.Task[None]] = set()
        self.audits = RelayAudits(self._audit_upstream, local_ranks, audit_window_s)

    @property
    def upstream(self) -> str:
        return self.upstreams.current

    def _connect(self) -> None:
        """Calls go to the upstream tried now from here on (its channel made once)."""
        addr = self.upstreams.current
        if addr not in self._channels:
            # Keepalive upstream: a coordinator that stops answering (a black-holed link,
            # whose close may be lost too) fails the group's call, and the relay re-joins.
            self._channels[addr] = self._security.aio_channel(
                addr, keepalive_client_options(self._rank_grace_s)
            )
        self.channel = self._channels[addr]
        self.stub = pb_grpc.CohortServiceStub(self.channel)
        # Uploads (whole or in chunks) pass through as the bytes the rank sent (see
        # RAW_CHUNKS): never decoded.
        service = pb.DESCRIPTOR.services_by_name["CohortService"]
        self.raw: dict[str, Any] = {
            m.name: (self.channel.stream_unary if m.client_streaming else self.channel.unary_unary)(
                f"/{service.full_name}/{m.name}",
                response_deserializer=getattr(pb, m.output_type.name).FromString,
            )
            for m in service.methods
            if m.name in RAW_CHUNKS
        }

    def _follow(self, exc: grpc.aio.AioRpcError) -> bool:
        """An UNAVAILABLE from the upstream: to the leader it named, or the next replica.
        True when the group re-joins there at once."""
        was = self.upstreams.current
        wait = self.upstreams.failed(exc)
        if self.upstreams.current != was:
            log.info("upstream moved", was=was, now=self.upstreams.current)
            self._connect()
        return wait == 0.0

    async def Audit(
        self, request: pb.AuditRequest, context: grpc.aio.ServicerContext
    ) -> pb.AuditReply:
        """The node's audits, batched upstream (relay_audits.py)."""
        try:
            return await self.audits.audit(request, auth_of(context))
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
            raise AssertionError("unreachable") from exc

    async def Settings(
        self, request: pb.SettingsRequest, context: grpc.aio.ServicerContext
    ) -> pb.SettingsReply:
        """The grace this relay applies: relays below it take it as theirs."""
        return pb.SettingsReply(rank_grace_s=self.rank_grace_s)

    async def upstream_grace(self, timeout_s: float) -> float | None:
        """The upstream's rank grace, or None when it cannot say (unreachable, or a
        coordinator older than the Settings call)."""
        try:
            reply: pb.SettingsReply = await self.stub.Settings(
                pb.SettingsRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("the upstream did not say its rank grace", code=exc.code().name)
            return None
        return reply.rank_grace_s if reply.rank_grace_s > 0 else None

    async def _audit_upstream(
        self, request: pb.AuditRequest, metadata: Sequence[tuple[str, str]]
    ) -> pb.AuditReply:
        """One batch upstream; a standby's answer moves it to the leader it names."""
        for _ in range(len(self.upstreams.addrs) + 1):
            try:
                reply: pb.AuditReply = await self.stub.Audit(
                    request, metadata=metadata, timeout=AUDIT_TIMEOUT_S
                )
                return reply
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or not self._follow(exc):
                    raise
        return await self.stub.Audit(request, metadata=metadata, timeout=AUDIT_TIMEOUT_S)  # type: ignore[no-any-return]

    def Join(
        self, request: pb.JoinRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JoinEvent]:
        return self._joined([request], context, relayed=False)

    async def _joined(
        self, requests: list[pb.JoinRequest], context: grpc.aio.ServicerContext, *, relayed: bool
    ) -> AsyncIterator[pb.JoinEvent]:
        """Ranks of one call (a rank's Join, or a lower relay's JoinGroup) into the pending
        group of their job; the call's events until the verdict."""
        auth = auth_of(context)
        first = requests[0]
        key: GroupKey = (first.job_id, first.world_size, first.round, auth[0][1] if auth else "")
        group = self._pending.get(key)
        # each member's size, plus its JoinGroupRequest.members field's tag and length
        size = sum(r.ByteSize() + 8 for r in requests)
        if group is not None and (
            any(r.rank in group.ranks for r in requests)  # a rank again (a restarted process)
            or group.bytes + size > self.max_message_bytes  # the coordinator's message limit
        ):
            self._send(group)  # goes as it is; these ranks start the next group
            group = None
        if group is None:
            group = self._pending[key] = Group(key, auth)
            group.timer = asyncio.get_running_loop().call_later(self.window_s, self._send, group)
        events: asyncio.Queue[pb.JoinEvent | Status] = asyncio.Queue()
        mine = {r.rank: Rank(r, events, relayed=relayed) for r in requests}
        group.ranks.update(mine)
        group.bytes += size
        # grpc.aio does not always cancel a handler whose client went away; its context's
        # done callback always runs.
        context.add_done_callback(lambda _: events.put_nowait(GONE))
        if len(group.ranks) + self._sent.get(key, 0) >= self.local_ranks:
            self._send(group)
        decided = False
        try:
            while True:
                item = await events.get()
                if item is GONE:
                    return
                if isinstance(item, Status):
                    await context.abort(item.code, item.details)
                    return
                yield item
                if item.WhichOneof("event") == "verdict":
                    decided = True
                    return
        finally:
            if not decided:
                for rank_id, rank in mine.items():
                    self._left(group, rank_id, rank)

    # Uploads pass through as they came (raw bytes, or a stream of raw chunks: see
    # RAW_REQUESTS, RAW_CHUNKS) with the rank's token; the answer or error comes back.
    UploadManifest = forwarding("UploadManifest")
    UploadDigests = forwarding("UploadDigests")
    UploadFiles = forwarding("UploadFiles")
    UploadManifestChunks = forwarding("UploadManifestChunks")
    UploadDigestsChunks = forwarding("UploadDigestsChunks")

    async def JoinGroup(
        self, request: pb.JoinGroupRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.JoinEvent]:
        """A lower relay's group (relays of relays): its ranks join this relay's group for
        their job, and the lower relay gets the events once for all of them."""
        try:
            members = members_of(request)
        except ValueError:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a class of the group holds columns of different lengths: one value per rank",
            )
        jobs = {(m.job_id, m.world_size, m.round) for m in members}
        if len(jobs) != 1 or len({m.rank for m in members}) != len(members):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a group joins distinct ranks of one job, world size and round; got "
                f"{len(members)} members of {len(jobs)} jobs",
            )
        async for event in self._joined(members, context, relayed=True):
            yield event

    async def JoinPoll(
        self, request: pb.JoinGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.JoinEvent:
        """A coordinator's call: a relay below this one joins on a JoinGroup stream (it
        falls back to one on this answer); the hop to the coordinator polls."""
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "a relay takes JoinGroup from the relays below it, not JoinPoll",
        )
        raise AssertionError("unreachable")  # abort raises

    # -- groups ------------------------------------------------------------------------
    def _send(self, group: Group) -> None:
        if self._pending.get(group.key) is group:
            del self._pending[group.key]
        if group.timer is not None:
            group.timer.cancel()
            group.timer = None
        if group.call is not None or not group.ranks:
            return
        self._sent[group.key] = self._sent.get(group.key, 0) + len(group.ranks)
        task = asyncio.get_running_loop().create_task(self._run(group))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _left(self, group: Group, rank_id: int, rank: Rank) -> None:
        if group.ranks.get(rank_id) is not rank:
            return
        del group.ranks[rank_id]
        if group.decided:
            return
        if group.call is None:  # not sent yet
            if not group.ranks:
                self._send(group)  # nobody left: drops the pending group
            return
        group.regroup = True  # the others re-join without it
        group.call.cancel()

    async def _upstream(
        self, group: Group, members: dict[int, Rank]
    ) -> AsyncIterator[pb.JoinEvent]:
        """The group's events from upstream: on a JoinGroup stream (the default: cheaper
        at scale, see README, Performance), or by JoinPoll, a call per event, falling back
        to the stream where the upstream has none. Ends early when a rank left between two
        polls."""

        def request() -> pb.JoinGroupRequest:  # as they are now: the round pinned
            sent = self.formats.group(self.upstream, [r.request for r in members.values()])
            group.sent_classes = bool(sent.ranks)
            return sent

        while self.polling:
            call = group.call = self.stub.JoinPoll(request(), metadata=group.metadata)
            try:
                event = await call
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self.polling = False
                log.info("the upstream has no JoinPoll (before 0.3): joining on a stream")
                break
            yield event
            if event.WhichOneof("event") == "verdict" or group.regroup:
                return
        call = group.call = self.stub.JoinGroup(request(), metadata=group.metadata)
        async for event in call:
            yield event

    async def _run(self, group: Group) -> None:
        while group.ranks:
            group.regroup = False
            members = dict(group.ranks)
            try:
                if await self._relayed(group, members):
                    return
                if group.regroup:
                    # A rank left between two polls: the next poll, without it, is its
                    # leave upstream, at once (no round was abandoned: no pause). Said as
                    # when a call was cancelled: which path ran depends only on timing.
                    if group.ranks:
                        log.info("rank left; re-joining the rest", job=group.key[0])
                    continue
                status = Status(
                    grpc.StatusCode.UNAVAILABLE,
                    f"the coordinator at {self.upstream} ended the group without a verdict",
                )
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
                # Our own cancel (a rank left) ends the iteration with CancelledError.
                if group.regroup:
                    await self._regroup(group)
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    raise
                # (CANCELLED: by the upstream, as a coordinator stops; our own cancel, a
                # rank that left, ends the iteration with CancelledError above)
                if await self._again(group, members, exc):
                    continue
                status = Status(exc.code(), exc.details() or "")
            for events in {id(r.events): r.events for r in members.values()}.values():
                events.put_nowait(status)
            return

    async def _again(
        self, group: Group, members: dict[int, Rank], exc: grpc.aio.AioRpcError
    ) -> bool:
        """Whether the group re-joins after this error (once the upstream answers again,
        or at once, one request per rank, where it reads no rank classes)."""
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            await self._unavailable(group, members, exc)
            return True
        return self.formats.older(self.upstream, exc, group.sent_classes)

    async def _unavailable(
        self, group: Group, members: dict[int, Rank], exc: grpc.aio.AioRpcError
    ) -> None:
        """Before the group re-joins: at once where a standby named the leader (or another
        replica is untried); else the link or the coordinator went (a partition, a
        restart), and the ranks stay held here until it answers again."""
        if self._follow(exc):
            return
        if group.lost is None:
            group.lost = Outage(self.upstream, group, exc.details() or "")
        await group.lost.wait(members, self._dispatch)

    async def _relayed(self, group: Group, members: dict[int, Rank]) -> bool:
        """The group's events to its ranks; True once the verdict went out."""
        async for event in self._upstream(group, members):
            self.upstreams.reached()
            if group.lost is not None:
                group.lost.over(group)
                group.lost = None
            self._dispatch(event, members)
            if event.WhichOneof("event") == "verdict":
                group.decided = True
                self._sent.pop(group.key, None)  # the next round batches afresh
                return True
        return False

    @staticmethod
    async def _regroup(group: Group) -> None:
        """Ranks of a node die together (a Ctrl-C, torchrun tearing its workers down): one
        pause gathers them, so the rest re-join once, not once per dying rank (each re-join
        was a round abandoned upstream)."""
        await asyncio.sleep(REGROUP_S)  # _run clears group.regroup before the re-join
        if group.ranks:
            log.info("rank left; re-joining the rest", job=group.key[0])

    def _dispatch(self, event: pb.JoinEvent, members: dict[int, Rank]) -> None:
        kind = event.WhichOneof("event")
        if kind in ("manifest_request", "digest_request"):
            named = (
                event.manifest_request.rank
                if kind == "manifest_request"
                else event.digest_request.rank
            )
            asked = members.get(named)
            if asked is not None:
                asked.events.put_nowait(event)
            return
        calls: dict[int, asyncio.Queue[pb.JoinEvent | Status]] = {}
        for r in members.values():
            if kind == "progress":
                # A re-join after a rank left must land in the same round.
                r.request.round = event.progress.round
                if r.told and r.request.quiet and not r.relayed:
                    continue
                r.told = True
            calls[id(r.events)] = r.events  # once per call: a lower relay's group shares one
        for events in calls.values():
            events.put_nowait(event)

    async def close(self) -> None:
        self.audits.close()
        for task in list(self._tasks):
            task.cancel()
        for channel in self._channels.values():
            await channel.close()
