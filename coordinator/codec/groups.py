"""A relay's group on the wire: per-rank join requests <-> `JoinGroupRequest.ranks`, the
classes of ranks whose requests differ only in who sent them (rank, local rank, host, pid,
incarnation). A node's ranks normally form one class, so the coordinator validates, admits
and holds the shared part once per call, not once per rank.

Structural only (no validation: the coordinator's `edge.joins.group_intents` validates what
arrives); used by relays on both sides of a hop, and by the benches and tests that play one.
"""

from __future__ import annotations

from collections.abc import Iterable

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb

# What each rank of a class holds on its own, in `RankClass`'s columns.
OWN = ("rank", "local_rank", "pid", "incarnation", "host")


def as_classes(members: Iterable[pb.JoinRequest]) -> pb.JoinGroupRequest:
    """Per-rank requests as classes, in the order each class first appears; ranks of one
    host leave the class's host column empty (`join.host` says it once)."""
    classes: dict[bytes, pb.RankClass] = {}
    for member in members:
        shared = pb.JoinRequest()
        shared.CopyFrom(member)
        for name in OWN:
            shared.ClearField(name)  # type: ignore[arg-type]  # a JoinRequest field
        key = shared.SerializeToString(deterministic=True)
        cls = classes.get(key)
        if cls is None:
            cls = classes[key] = pb.RankClass(join=shared)
        cls.rank.append(member.rank)
        cls.local_rank.append(member.local_rank)
        cls.pid.append(member.pid)
        cls.incarnation.append(member.incarnation)
        cls.host.append(member.host)
    for cls in classes.values():
        if len(set(cls.host)) == 1:
            cls.join.host = cls.host[0]
            del cls.host[:]
    return pb.JoinGroupRequest(ranks=classes.values())


def size_of(request: pb.JoinGroupRequest) -> int:
    """How many ranks a group holds, sent either way."""
    return len(request.members) + sum(len(cls.rank) for cls in request.ranks)


def members_of(request: pb.JoinGroupRequest) -> list[pb.JoinRequest]:
    """Every rank's own request in a group, whichever way it was sent: its members, then
    each class's ranks. ValueError where a class's columns differ in length."""
    out = list(request.members)
    for cls in request.ranks:
        hosts = list(cls.host) or [cls.join.host] * len(cls.rank)
        for rank, local, pid, incarnation, host in zip(
            cls.rank, cls.local_rank, cls.pid, cls.incarnation, hosts, strict=True
        ):
            member = pb.JoinRequest()
            member.CopyFrom(cls.join)
            member.rank, member.local_rank, member.pid = rank, local, pid
            member.incarnation, member.host = incarnation, host
            out.append(member)
    return out
