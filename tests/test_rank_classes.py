"""A relay's group sent as classes of ranks (`JoinGroupRequest.ranks`): the same intents as
the same ranks sent one request each, whatever the split; a class that does not hold
together is refused naming what is wrong; the round trip through codec.groups loses
nothing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec.groups import as_classes, members_of
from cohortgate.coordinator.contract.errors import InvalidArgument, LimitExceeded
from cohortgate.coordinator.edge import joins
from cohortgate.coordinator.state.base import JoinIntent
from tests.helpers import join_request, manifest_of

M, WIDE = manifest_of(), manifest_of(width=8)


def group(world: int, ranks: list[int], odd: dict[int, str]) -> list[pb.JoinRequest]:
    """Ranks of one job as agents send them (rank 0 loud, the rest quiet), each on the host
    of its 4; `odd`: ranks that differ from their class (another model, another config,
    a restart)."""
    out = []
    for r in ranks:
        req = join_request("c", r, world, WIDE if odd.get(r) == "model" else M, quiet=r != 0)
        if odd.get(r) == "config":
            req.config.fields.update({"n_layer": "13"})
        if odd.get(r) == "restart":
            req.restart_count = 1
        out.append(req)
    return out


def described(intents: list[JoinIntent]) -> list[tuple[Any, ...]]:
    """What a group's intents say, by rank (the order of a request's parts is its own)."""
    return sorted(
        (i.member.rank, i.job_id, i.round, i.world_size, i.quiet, i.member) for i in intents
    )


@settings(max_examples=60, deadline=None)
@given(
    ranks=st.sets(st.integers(0, 15), min_size=1),
    odd=st.dictionaries(st.integers(0, 15), st.sampled_from(["model", "config", "restart"])),
    alone=st.sets(st.integers(0, 15)),
)
def test_classes_and_members_say_the_same_whatever_the_split(
    ranks: set[int], odd: dict[int, str], alone: set[int]
) -> None:
    requests = group(16, sorted(ranks), odd)
    one_each = joins.group_intents(pb.JoinGroupRequest(members=requests))
    split = as_classes(r for r in requests if r.rank not in alone)
    split.members.extend(r for r in requests if r.rank in alone)
    assert described(joins.group_intents(split)) == described(one_each)
    assert sorted(r.SerializeToString() for r in members_of(split)) == sorted(
        r.SerializeToString() for r in requests
    )


def test_a_nodes_ranks_are_one_class_and_rank_0_and_a_differing_rank_their_own() -> None:
    requests = group(8, list(range(8)), {5: "model"})
    for r in requests:
        r.host = "node0"
    sent = as_classes(requests)
    assert [list(c.rank) for c in sent.ranks] == [[0], [1, 2, 3, 4, 6, 7], [5]]
    assert all(c.join.host == "node0" and not c.host for c in sent.ranks)
    # the shared part once per class: smaller than the requests one by one
    assert sent.ByteSize() < pb.JoinGroupRequest(members=requests).ByteSize()


def test_a_class_of_many_hosts_keeps_one_host_per_rank() -> None:
    requests = group(8, list(range(1, 8)), {})  # hosts of 4: host0 and host1
    (cls,) = as_classes(requests).ranks
    assert list(cls.host) == [r.host for r in requests] and not cls.join.host
    intents = joins.group_intents(pb.JoinGroupRequest(ranks=[cls]))
    assert [i.member.host for i in intents] == ["host0"] * 3 + ["host1"] * 4


def refused(cls: pb.RankClass, *members: pb.JoinRequest) -> str:
    with pytest.raises(InvalidArgument) as raised:
        joins.group_intents(pb.JoinGroupRequest(members=members, ranks=[cls]))
    return str(raised.value)


def test_a_class_that_does_not_hold_together_is_refused_naming_what_is_wrong() -> None:
    def cls() -> pb.RankClass:
        (one,) = as_classes(group(8, [1, 2, 3], {})).ranks
        return one

    empty = pb.RankClass(join=cls().join)
    assert refused(empty, join_request("c", 0, 8, M)) == (
        "ranks[0] (0 ranks): the class has no ranks; each class names at least one"
    )
    for column in ("local_rank", "pid", "incarnation"):
        short = cls()
        del getattr(short, column)[-1]
        assert refused(short) == (
            f"ranks[0] (3 ranks): the class has 3 ranks and 2 {column} values: each column "
            "holds one value per rank"
        )
    hosts = cls()
    hosts.host.append("host9")
    assert refused(hosts) == (
        "ranks[0] (3 ranks): the class has 3 ranks and 1 host values: one per rank, or none "
        "for ranks of one host (join.host)"
    )
    for name, value in (("rank", 4), ("local_rank", 1), ("pid", 7), ("incarnation", "x")):
        own = cls()
        setattr(own.join, name, value)
        assert refused(own) == (
            f"ranks[0] (3 ranks): the class's join sets {name}: it holds what the ranks "
            "share, and each rank's own values go in the class's columns"
        ), name
    both = cls()
    both.host.extend(["a", "b", "c"])
    assert refused(both).startswith("ranks[0] (3 ranks): the class's join sets host: ")
    bad = cls()
    bad.incarnation[1] = "x" * 129
    assert refused(bad).startswith("ranks[0] (3 ranks): incarnation is 129 characters")
    loud = as_classes(group(8, [0, 1], {})).ranks[0]
    loud.join.init_method = ""
    assert refused(loud).startswith("ranks[0] (1 ranks): rank 0 offered no init_method")
    assert refused(cls(), join_request("c", 2, 8, M)) == (
        "ranks[0]: rank 2 appears twice in the group"
    )
    other = cls()
    other.join.job_id = "other"
    said = refused(other, join_request("c", 0, 8, M))
    assert said.startswith("ranks[0] (3 ranks) is of job 'other' world size 8 round 0, ")
    assert said.endswith(
        "members[0] of job 'c' world size 8 round 0: one group holds ranks of one job and round"
    ), said


def test_classes_count_toward_the_groups_limit() -> None:
    (cls,) = as_classes(group(joins.MAX_GROUP + 2, list(range(1, joins.MAX_GROUP + 1)), {})).ranks
    assert len(joins.group_intents(pb.JoinGroupRequest(ranks=[cls]))) == joins.MAX_GROUP
    with pytest.raises(LimitExceeded) as over:
        joins.group_intents(
            pb.JoinGroupRequest(ranks=[cls], members=[join_request("c", 0, joins.MAX_GROUP + 2, M)])
        )
    assert str(over.value) == (
        f"the group has {joins.MAX_GROUP + 1} members; the limit is {joins.MAX_GROUP} per call"
    )


def test_members_of_refuses_a_class_whose_columns_differ() -> None:
    (cls,) = as_classes(group(8, [1, 2], {})).ranks
    del cls.local_rank[0]
    with pytest.raises(ValueError):
        members_of(pb.JoinGroupRequest(ranks=[cls]))
