"""Servicer-side join requests -> intents: a rank's `Join`, a relay's `JoinGroup` (its
members one request each, or its classes of ranks: `codec/groups.py`), each validated into
one `JoinIntent` per rank, with what a call's ranks share validated once."""

from __future__ import annotations

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec.groups import OWN, size_of
from cohortgate.coordinator.codec.wire import (
    DEFAULT_LIMITS,
    MAX_JOB_ID,
    MAX_TEXT,
    PROTOCOL_VERSION,
    layout_from_pb,
    sha256,
    text,
)
from cohortgate.coordinator.contract.digests import DIGEST_FORMAT_VERSION
from cohortgate.coordinator.contract.errors import (
    CoordinatorError,
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
)
from cohortgate.coordinator.contract.fingerprint import AGREED, Fields, check_fields
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.contract.runtime import RUNTIME_FIELDS
from cohortgate.coordinator.decision.cohort import Member
from cohortgate.coordinator.edge.plumbing import parsed
from cohortgate.coordinator.state.base import JoinIntent


class Seen:
    """What one call's members share, validated once: a relay's group of K ranks of one node
    carries one job id, host, launch, runtime and model config K times. Keyed by the raw
    value, so a member that differs is validated on its own (and refused on its own)."""

    def __init__(self) -> None:
        self._texts: dict[tuple[str, str], str] = {}
        self._runtimes: dict[tuple[str, ...], dict[str, str]] = {}
        self._agreed: dict[tuple[str, bytes], Fields] = {}

    def text(self, value: str, field: str, limit: int = MAX_TEXT, *, required: bool = False) -> str:
        key = (field, value)
        done = self._texts.get(key)
        if done is None:
            done = self._texts[key] = text(value, field, limit, required=required)
        return done

    def runtime(self, req: pb.JoinRequest) -> dict[str, str]:
        values = tuple(getattr(req.runtime, f) for f in RUNTIME_FIELDS)
        done = self._runtimes.get(values)
        if done is None:
            checked = {
                f: text(v, f"runtime.{f}") for f, v in zip(RUNTIME_FIELDS, values, strict=True)
            }
            done = self._runtimes[values] = checked
        return done

    def agreed(self, req: pb.JoinRequest, name: str, limits: Limits) -> Fields:
        fingerprint = getattr(req, name)
        key = (name, fingerprint.SerializeToString(deterministic=True))
        done = self._agreed.get(key)
        if done is None:
            try:
                fields = fingerprint.fields.items()
                done = check_fields(name, fields, limits.max_fingerprint_fields)
            except OverflowError as exc:
                raise LimitExceeded(str(exc)) from None
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            self._agreed[key] = done
        return done


def join_intent(
    req: pb.JoinRequest, limits: Limits = DEFAULT_LIMITS, seen: Seen | None = None
) -> JoinIntent:
    """One join request validated into an intent; `seen`: what earlier members of the same
    call shared (validated once per call, not per rank)."""
    seen = seen or Seen()
    shared = _shared(req, limits, seen)
    if req.rank == 0:
        _offers_rendezvous(shared)
    return _as_rank(
        shared,
        req.rank,
        req.local_rank,
        seen.text(req.host, "host", required=True),
        req.pid,
        _incarnation(req.incarnation),
    )


MAX_INCARNATION = 128


def _incarnation(value: str) -> str:
    return text(value, "incarnation", MAX_INCARNATION, required=True)


def _shared(req: pb.JoinRequest, limits: Limits, seen: Seen) -> JoinIntent:
    """A join request validated but for who sent it (rank, local rank, host, pid,
    incarnation, left unset): what the ranks of one class share."""
    if req.protocol_version != PROTOCOL_VERSION:
        raise FailedPrecondition(
            f"agent speaks protocol {req.protocol_version}, coordinator {PROTOCOL_VERSION}: "
            "upgrade the older of the two so both speak the same version"
        )
    job_id = seen.text(req.job_id, "job_id", MAX_JOB_ID, required=True)
    if req.world_size == 0:
        raise InvalidArgument("world_size is 0; a cohort needs at least one rank")
    if req.world_size > limits.max_world_size:
        raise LimitExceeded(
            f"world_size {req.world_size} is above this coordinator's limit "
            f"max_world_size={limits.max_world_size}"
        )
    signature = sha256(req.signature, "signature")
    weights_digest = sha256(req.weights_digest, "weights_digest", optional=True)
    if req.weights_digest and req.weights_digest_format != DIGEST_FORMAT_VERSION:
        raise FailedPrecondition(
            f"weights_digest is in format {req.weights_digest_format}, this coordinator "
            f"compares format {DIGEST_FORMAT_VERSION} (cohortgate.digest.v"
            f"{DIGEST_FORMAT_VERSION}): upgrade the older of agent and coordinator"
        )
    if req.manifest_entries > limits.max_manifest_entries:
        raise LimitExceeded(
            f"manifest_entries {req.manifest_entries} is above the limit "
            f"max_manifest_entries={limits.max_manifest_entries}"
        )
    member = Member(
        rank=0,
        host="",
        pid=0,
        incarnation="",
        signature=signature,
        manifest_entries=req.manifest_entries,
        init_method=seen.text(req.init_method, "init_method"),
        runtime=seen.runtime(req),
        layout=layout_from_pb(req.layout, limits) if req.HasField("layout") else None,
        weights_digest=weights_digest,
        launch=seen.text(req.launch, "launch"),
        restart_count=req.restart_count,
        elastic=req.elastic,
        sharded_without_layout=req.sharded_without_layout,
        agreed={
            name: seen.agreed(req, name, limits)
            for name in AGREED
            if req.HasField(name)  # type: ignore[arg-type]  # one of AGREED's names
        },
    )
    return JoinIntent(
        job_id=job_id, round=req.round, member=member, world_size=req.world_size, quiet=req.quiet
    )


def _offers_rendezvous(rank0: JoinIntent) -> None:
    if not rank0.member.init_method:
        raise InvalidArgument(
            "rank 0 offered no init_method: rank 0 must offer the rendezvous endpoint "
            "(tcp://HOST:PORT) that the cohort will use"
        )


def _as_rank(
    shared: JoinIntent, rank: int, local_rank: int, host: str, pid: int, incarnation: str
) -> JoinIntent:
    """The shared part of a join as rank `rank` sent it."""
    return JoinIntent(
        shared.job_id,
        shared.round,
        shared.member.twin(rank, local_rank, host, pid, incarnation),
        shared.world_size,
        shared.quiet,
    )


def _columns(cls: pb.RankClass, n: int) -> None:
    """A class's columns hold one value per rank, and its join none of them."""
    for name, column in (
        ("local_rank", cls.local_rank),
        ("pid", cls.pid),
        ("incarnation", cls.incarnation),
    ):
        if len(column) != n:
            raise InvalidArgument(
                f"the class has {n} ranks and {len(column)} {name} values: each column "
                "holds one value per rank"
            )
    if cls.host and len(cls.host) != n:
        raise InvalidArgument(
            f"the class has {n} ranks and {len(cls.host)} host values: one per rank, or "
            "none for ranks of one host (join.host)"
        )
    join = cls.join
    # the host may be said once, in the join, for ranks of one host (no host column)
    own = [f for f in OWN if getattr(join, f) and (f != "host" or cls.host)]
    if own:
        raise InvalidArgument(
            f"the class's join sets {', '.join(own)}: it holds what the ranks share, and "
            "each rank's own values go in the class's columns"
        )


def class_intents(cls: pb.RankClass, limits: Limits, seen: Seen) -> list[JoinIntent]:
    """A class of ranks (one request and a column per rank of who sent it) validated into
    one intent per rank; the shared part validated once."""
    ranks = list(cls.rank)
    if not ranks:
        raise InvalidArgument("the class has no ranks; each class names at least one")
    n = len(ranks)
    _columns(cls, n)
    join = cls.join
    shared = _shared(join, limits, seen)
    if 0 in ranks:
        _offers_rendezvous(shared)
    # Each column checked as a whole (in C); a bad value is found and named one by one.
    hosts = list(cls.host) or [join.host] * n
    for host in set(hosts):
        seen.text(host, "host", required=True)
    incarnations = list(cls.incarnation)
    if not (
        all(incarnations)
        and max(map(len, incarnations)) <= MAX_INCARNATION
        and all(map(str.isprintable, incarnations))
    ):
        for incarnation in incarnations:
            _incarnation(incarnation)
    return [
        _as_rank(shared, rank, local, host, pid, inc)
        for rank, local, host, pid, inc in zip(
            ranks, cls.local_rank, hosts, cls.pid, incarnations, strict=True
        )
    ]


# Members of one JoinGroup call: a node's local ranks (8 on a GPU node); room for big hosts.
MAX_GROUP = 1024


def _parts(req: pb.JoinGroupRequest, limits: Limits) -> list[tuple[str, list[JoinIntent]]]:
    """Each member's intent, then each class's intents, with where in the request each
    came from; an error names where."""
    seen = Seen()
    parts: list[tuple[str, list[JoinIntent]]] = []
    for i, member in enumerate(req.members):
        where = f"members[{i}] (rank {member.rank})"
        try:
            parts.append((where, [join_intent(member, limits, seen)]))
        except CoordinatorError as exc:
            exc.args = (f"{where}: {exc}",)
            raise
    for i, cls in enumerate(req.ranks):
        where = f"ranks[{i}] ({len(cls.rank)} ranks)"
        try:
            parts.append((where, class_intents(cls, limits, seen)))
        except CoordinatorError as exc:
            exc.args = (f"{where}: {exc}",)
            raise
    return parts


def group_intents(req: pb.JoinGroupRequest, limits: Limits = DEFAULT_LIMITS) -> list[JoinIntent]:
    """A relay's group: every member valid, one job and world size, no rank twice."""
    count = size_of(req)
    if not count:
        raise InvalidArgument("the group has no members; a JoinGroup call needs at least one")
    if count > MAX_GROUP:
        raise LimitExceeded(f"the group has {count} members; the limit is {MAX_GROUP} per call")
    parts = _parts(req, limits)
    first_where, (first, *_) = parts[0]
    for where, (intent, *_) in parts:
        if (intent.job_id, intent.world_size, intent.round) != (
            first.job_id,
            first.world_size,
            first.round,
        ):
            raise InvalidArgument(
                f"{where} is of job '{intent.job_id}' world size {intent.world_size} round "
                f"{intent.round}, {first_where.split(' (')[0]} of job '{first.job_id}' world "
                f"size {first.world_size} round {first.round}: one group holds ranks of one "
                "job and round"
            )
    intents = [intent for _, part in parts for intent in part]
    if len({i.member.rank for i in intents}) != len(intents):
        _twice(parts)
    return intents


def _twice(parts: list[tuple[str, list[JoinIntent]]]) -> None:
    """The first rank a group holds twice, named with where it came again."""
    ranks: set[int] = set()
    for where, part in parts:
        for intent in part:
            if intent.member.rank in ranks:
                raise InvalidArgument(
                    f"{where.split(' (')[0]}: rank {intent.member.rank} appears twice in the group"
                )
            ranks.add(intent.member.rank)


def join_intents(data: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[str, list[JoinIntent]]:
    """A Join request's bytes: its job id, and its one validated intent."""
    req: pb.JoinRequest = parsed(pb.JoinRequest, data)
    return req.job_id, [join_intent(req, limits)]


def group_join_intents(
    data: bytes, limits: Limits = DEFAULT_LIMITS
) -> tuple[str, list[JoinIntent]]:
    """A JoinGroup request's bytes: its job id, and every member's validated intent."""
    req: pb.JoinGroupRequest = parsed(pb.JoinGroupRequest, data)
    intents = group_intents(req, limits)
    return intents[0].job_id, intents
