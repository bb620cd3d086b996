"""The relay's pieces (edge/relay.py): a rank it holds, a group it joins upstream as one
call (as classes of ranks, or one request per rank to an older upstream), an upstream outage
it rides out, and the calls it forwards as they came."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
import structlog

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec.groups import as_classes

if TYPE_CHECKING:
    from cohortgate.coordinator.edge.relay import Relay

log = structlog.get_logger("cohortgate.relay")

GroupKey = tuple[str, int, int, str]  # job, world size, round, authorization
# After a rank leaves, the rest of its group re-join this much later: the ranks of a node
# that is going down leave within it, and nobody is re-joined for them.
REGROUP_S = 0.3


@dataclass(frozen=True)
class Status:
    """An upstream error to pass on to a rank as its own call's status."""

    code: grpc.StatusCode
    details: str


GONE = Status(grpc.StatusCode.CANCELLED, "the rank's call ended")


@dataclass
class Rank:
    request: pb.JoinRequest
    # Where its events go: its own call's queue, or (relayed) its lower relay's call's
    # queue, shared by every rank of that group.
    events: asyncio.Queue[pb.JoinEvent | Status] = field(default_factory=asyncio.Queue)
    told: bool = False  # has had its first progress event
    relayed: bool = False  # joined by a relay below: it filters progress per rank itself


@dataclass
class Group:
    key: GroupKey
    metadata: Sequence[tuple[str, str]]
    ranks: dict[int, Rank] = field(default_factory=dict)
    timer: asyncio.TimerHandle | None = None
    call: grpc.aio.Call | None = None  # the upstream call in flight
    regroup: bool = False  # the upstream call was cancelled because a rank left
    decided: bool = False
    bytes: int = 0  # the JoinGroupRequest's size
    lost: Outage | None = None  # the upstream is gone, since
    sent_classes: bool = False  # its last request went up as classes of ranks


class Outage:
    """The upstream went while a group waited: logged once, the group's ranks told (those
    that are not quiet: rank 0 prints it), the group re-joined every ~second until the
    coordinator answers again, and the recovery logged with how long it took."""

    RETRY_S = (0.2, 0.5, 1.0)
    TELL_EVERY_S = 10.0

    def __init__(self, upstream: str, group: Group, details: str) -> None:
        self.upstream = upstream
        self.since = time.monotonic()
        self.attempts = 0
        self.told_at = float("-inf")
        self.message = (
            f"the relay lost the coordinator at {upstream} ({first_line(details)}); "
            "it holds this node's ranks and re-joins them once it answers"
        )
        log.warning(
            "upstream lost; holding the ranks and re-joining",
            job=group.key[0],
            ranks=len(group.ranks),
            upstream=upstream,
            error=first_line(details),
        )

    async def wait(
        self,
        members: dict[int, Rank],
        dispatch: Callable[[pb.JoinEvent, dict[int, Rank]], None],
    ) -> None:
        now = time.monotonic()
        if now - self.told_at >= self.TELL_EVERY_S:
            self.told_at = now
            first = next(iter(members.values())).request
            progress = pb.Progress(
                job_id=first.job_id,
                round=first.round,
                expected=first.world_size,
                message=f"{self.message} (unreachable for {now - self.since:.0f}s)",
            )
            dispatch(pb.JoinEvent(progress=progress), members)
        await asyncio.sleep(self.RETRY_S[min(self.attempts, len(self.RETRY_S) - 1)])
        self.attempts += 1

    def over(self, group: Group) -> None:
        log.info(
            "upstream back; the ranks re-joined",
            job=group.key[0],
            ranks=len(group.ranks),
            upstream=self.upstream,
            unreachable_s=round(time.monotonic() - self.since, 2),
            attempts=self.attempts,
        )


class GroupFormats:
    """How each upstream takes a group: as classes of ranks (`codec/groups.py`), or, where
    it is older than them, one request per rank."""

    def __init__(self) -> None:
        self._older: set[str] = set()  # upstreams that read no rank classes

    def group(self, upstream: str, joins: list[pb.JoinRequest]) -> pb.JoinGroupRequest:
        if upstream in self._older:
            return pb.JoinGroupRequest(members=joins)
        return as_classes(joins)

    def older(self, upstream: str, exc: grpc.aio.AioRpcError, sent_classes: bool) -> bool:
        """An upstream older than rank classes reads a group sent as classes as empty (a
        coordinator: "the group has no members"; a relay: "got 0 members"): from then on
        it gets one request per rank. True for every group sent as classes that it read so
        (the first, and any sent beside it before its answer came): each re-joins at once."""
        details = exc.details() or ""
        if (
            not sent_classes
            or exc.code() != grpc.StatusCode.INVALID_ARGUMENT
            or ("the group has no members" not in details and "got 0 members" not in details)
        ):
            return False
        if upstream not in self._older:
            self._older.add(upstream)
            log.warning(
                "the upstream reads no rank classes (an older version): sending it one "
                "request per rank",
                upstream=upstream,
            )
        return True


def first_line(text: str) -> str:
    return text.strip().splitlines()[0][:200] if text.strip() else "no details"


def auth_of(context: grpc.aio.ServicerContext) -> list[tuple[str, str]]:
    """The rank's bearer token, passed upstream as it came."""
    return [
        (m.key, str(m.value))
        for m in context.invocation_metadata() or ()
        if m.key == "authorization"
    ]


async def forward_call(method: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
    """A call (its request, or its stream of chunks) passed upstream with the rank's token;
    its error passed back as it came."""
    try:
        return await method(request, metadata=auth_of(context), timeout=context.time_remaining())
    except grpc.aio.AioRpcError as exc:
        await context.abort(exc.code(), exc.details() or "")
        raise AssertionError("unreachable") from exc


def forwarding(method: str) -> Any:
    """A servicer method that forwards its call upstream on `self.raw[method]`."""

    async def forward(self: Relay, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await forward_call(self.raw[method], request, context)

    forward.__name__ = method
    return forward
