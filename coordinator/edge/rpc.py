"""Servicer-side proto -> domain: join requests and uploads validated into intents, refs,
manifests and digests. (Replies out are `replies`; the agent-safe part is `codec.wire`.)"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import Message

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec.wire import (
    DEFAULT_LIMITS,
    MAX_JOB_ID,
    MAX_NAME,
    MAX_TEXT,
    PROTOCOL_VERSION,
    layout_from_pb,
    manifest_from_pb,
    sha256,
    text,
)
from cohortgate.coordinator.contract.digests import DIGEST_FORMAT_VERSION, MAX_FILE_PATH, MAX_FILES
from cohortgate.coordinator.contract.errors import (
    CoordinatorError,
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
)
from cohortgate.coordinator.contract.fingerprint import AGREED, Fields, check_fields
from cohortgate.coordinator.contract.limits import MAX_AUDITS_PER_CALL, Limits
from cohortgate.coordinator.contract.manifest import HeldManifest
from cohortgate.coordinator.contract.runtime import RUNTIME_FIELDS
from cohortgate.coordinator.decision.audit import RankAudit
from cohortgate.coordinator.decision.cohort import Member
from cohortgate.coordinator.decision.stall import Beat, Snapshot
from cohortgate.coordinator.edge.plumbing import Malformed, parse_request
from cohortgate.coordinator.state.asks import UploadRef
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
    return _as_rank(
        _shared(req, limits, seen),
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


def _as_rank(
    shared: JoinIntent, rank: int, local_rank: int, host: str, pid: int, incarnation: str
) -> JoinIntent:
    """The shared part of a join as rank `rank` sent it."""
    if rank == 0 and not shared.member.init_method:
        raise InvalidArgument(
            "rank 0 offered no init_method: rank 0 must offer the rendezvous endpoint "
            "(tcp://HOST:PORT) that the cohort will use"
        )
    return JoinIntent(
        shared.job_id,
        shared.round,
        shared.member.twin(rank, local_rank, host, pid, incarnation),
        shared.world_size,
        shared.quiet,
    )


def class_intents(cls: pb.RankClass, limits: Limits, seen: Seen) -> list[JoinIntent]:
    """A class of ranks (one request and a column per rank of who sent it) validated into
    one intent per rank; the shared part validated once."""
    ranks = list(cls.rank)
    if not ranks:
        raise InvalidArgument("the class has no ranks; each class names at least one")
    n = len(ranks)
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
    own = [f for f in ("rank", "local_rank", "pid", "incarnation") if getattr(join, f)]
    if cls.host and join.host:
        own.append("host")
    if own:
        raise InvalidArgument(
            f"the class's join sets {', '.join(own)}: it holds what the ranks share, and "
            "each rank's own values go in the class's columns"
        )
    shared = _shared(join, limits, seen)
    hosts = (
        [seen.text(h, "host", required=True) for h in cls.host]
        if cls.host
        else [seen.text(join.host, "host", required=True)] * n
    )
    return [
        _as_rank(shared, rank, local, host, pid, _incarnation(inc))
        for rank, local, host, pid, inc in zip(
            ranks, cls.local_rank, hosts, cls.pid, cls.incarnation, strict=True
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
    count = len(req.members) + sum(len(cls.rank) for cls in req.ranks)
    if not count:
        raise InvalidArgument("the group has no members; a JoinGroup call needs at least one")
    if count > MAX_GROUP:
        raise LimitExceeded(f"the group has {count} members; the limit is {MAX_GROUP} per call")
    parts = _parts(req, limits)
    intents: list[JoinIntent] = []
    first_where, (first, *_) = parts[0]
    ranks: set[int] = set()
    for where, part in parts:
        intent = part[0]
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
        for intent in part:
            if intent.member.rank in ranks:
                raise InvalidArgument(
                    f"{where.split(' (')[0]}: rank {intent.member.rank} appears twice in the group"
                )
            ranks.add(intent.member.rank)
        intents += part
    return intents


def _parsed(cls: type[Message], data: bytes, sent: type[Message] | None = None) -> Any:
    """`data` as a `cls` message, or INVALID_ARGUMENT naming the message `sent` (default
    `cls`: a header read from the front of a larger message names the larger one)."""
    message = parse_request(cls, data)
    if isinstance(message, Malformed):
        raise InvalidArgument(message.message.replace(cls.__name__, (sent or cls).__name__))
    return message


def join_intents(data: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[str, list[JoinIntent]]:
    """A Join request's bytes: its job id, and its one validated intent."""
    req: pb.JoinRequest = _parsed(pb.JoinRequest, data)
    return req.job_id, [join_intent(req, limits)]


def group_join_intents(
    data: bytes, limits: Limits = DEFAULT_LIMITS
) -> tuple[str, list[JoinIntent]]:
    """A JoinGroup request's bytes: its job id, and every member's validated intent."""
    req: pb.JoinGroupRequest = _parsed(pb.JoinGroupRequest, data)
    intents = group_intents(req, limits)
    return intents[0].job_id, intents


def _front(data: bytes, fields: int) -> bytes:
    """The bytes of `data` up to its first field numbered above `fields` (protobuf encoders
    write fields in number order; a message that does not is read whole)."""
    pos, end = 0, len(data)
    while pos < end:
        start = pos
        tag, pos = _varint(data, pos)
        if pos > end or tag >> 3 == 0:
            return data  # not protobuf: let the parser say so
        if tag >> 3 > fields:
            return data[:start]
        wire = tag & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            pos += length
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            return data  # groups: let the parser judge
    return data


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
    return value, len(data) + 1  # truncated: the parser reports it


def upload_header(data: bytes, sent: type[Message]) -> pb.UploadManifestHeader:
    """The first fields of an upload (UploadManifestRequest or UploadDigestsRequest share
    fields 1-4; 5 is the manifest's signature), read from the front of the bytes only: the
    payload is neither decoded nor copied. Errors name the message `sent`."""
    fields = 5 if sent is pb.UploadManifestRequest else 4
    head: pb.UploadManifestHeader = _parsed(pb.UploadManifestHeader, _front(data, fields), sent)
    return head


def manifest_of(data: bytes, limits: Limits = DEFAULT_LIMITS) -> HeldManifest:
    """The whole upload decoded, validated, hashed and compacted (in a worker thread when
    large: O(entries)); the event loop only compares its signature and length."""
    req: pb.UploadManifestRequest = _parsed(pb.UploadManifestRequest, data)
    return HeldManifest(manifest_from_pb(req.manifest, limits))


def digests_of(data: bytes, limits: Limits = DEFAULT_LIMITS) -> list[bytes]:
    req: pb.UploadDigestsRequest = _parsed(pb.UploadDigestsRequest, data)
    if len(req.digests) > limits.max_manifest_entries:
        raise LimitExceeded(
            f"{len(req.digests)} digests; the limit is "
            f"max_manifest_entries={limits.max_manifest_entries}"
        )
    return [bytes(d) for d in req.digests]


def files_of(req: pb.UploadFilesRequest) -> tuple[UploadRef, list[tuple[str, bytes]]]:
    """An UploadFiles answer: who sends it, and its (path, digest) pairs, each checked."""
    if len(req.paths) != len(req.digests):
        raise InvalidArgument(f"{len(req.paths)} paths for {len(req.digests)} digests")
    if len(req.paths) > MAX_FILES:
        raise LimitExceeded(f"{len(req.paths)} code files; the limit is {MAX_FILES}")
    files = [
        (text(p, "paths", MAX_FILE_PATH, required=True), sha256(d, "digests"))
        for p, d in zip(req.paths, req.digests, strict=True)
    ]
    if len({p for p, _ in files}) != len(files):
        raise InvalidArgument("a path is named twice in the code files")
    ref = UploadRef(
        text(req.job_id, "job_id", MAX_JOB_ID, required=True),
        req.round,
        req.rank,
        text(req.incarnation, "incarnation", 128, required=True),
    )
    return ref, files


def upload_ref(req: pb.UploadManifestHeader) -> UploadRef:
    """Who an upload says it comes from (checked against the cohort's members)."""
    return UploadRef(
        text(req.job_id, "job_id", MAX_JOB_ID, required=True),
        req.round,
        req.rank,
        text(req.incarnation, "incarnation", 128, required=True),
    )


# -- audits and step marks ----------------------------------------------------------------
# A stack snapshot's bounds: frames kept (innermost first) and characters per frame or name.
MAX_SNAPSHOT_FRAMES = 32
MAX_FRAME_TEXT = 512


def audits_of(
    req: pb.AuditRequest, limits: Limits = DEFAULT_LIMITS
) -> tuple[list[RankAudit], list[Beat]]:
    """An AuditRequest's audits (digests to compare) and step marks (every audit marks its
    step too), each validated (one job per request)."""
    if not req.audits:
        raise InvalidArgument("the AuditRequest holds no audits")
    if len(req.audits) > MAX_AUDITS_PER_CALL:
        raise LimitExceeded(
            f"{len(req.audits)} audits in one request; the limit is {MAX_AUDITS_PER_CALL}"
        )
    seen = Seen()
    audits: list[RankAudit] = []
    beats: list[Beat] = []
    for a in req.audits:
        audit, beat = _audit(a, limits, seen)
        if audit is not None:
            audits.append(audit)
        beats.append(beat)
    if len({b.job_id for b in beats}) > 1:
        raise InvalidArgument("an AuditRequest carries the audits of one job only")
    return audits, beats


def _seconds(value: float, field: str) -> float:
    if not 0.0 <= value < 1e9:  # also NaN
        raise InvalidArgument(f"{field} {value!r} is not a number of seconds in 0..1e9")
    return value


def _snapshot(s: pb.StackSnapshot) -> Snapshot:
    if len(s.frames) > MAX_SNAPSHOT_FRAMES:
        raise InvalidArgument(
            f"a stack snapshot of {len(s.frames)} frames; the limit is {MAX_SNAPSHOT_FRAMES}"
        )
    return Snapshot(
        where=text(s.where, "snapshot.where", MAX_FRAME_TEXT, required=True),
        call=text(s.call, "snapshot.call", MAX_FRAME_TEXT),
        via=text(s.via, "snapshot.via", MAX_FRAME_TEXT),
        frames=tuple(text(f, "snapshot.frames", MAX_FRAME_TEXT) for f in s.frames),
    )


def _tensors(a: pb.RankAudit, limits: Limits) -> tuple[tuple[str, bytes], ...] | None:
    """The per-tensor digests of an audit that carries them; a step mark carries none."""
    if a.step_only:
        if a.digest or a.tensor_names or a.tensor_digests:
            raise InvalidArgument("a step mark (step_only) carries no digest")
    elif a.tensor_names or a.tensor_digests:
        if len(a.tensor_names) != len(a.tensor_digests):
            raise InvalidArgument(
                f"{len(a.tensor_names)} tensor names for {len(a.tensor_digests)} digests"
            )
        if len(a.tensor_names) > limits.max_manifest_entries:
            raise LimitExceeded(
                f"{len(a.tensor_names)} tensor digests; the limit is max_manifest_entries="
                f"{limits.max_manifest_entries}"
            )
        return tuple(
            (text(n, "tensor_names", MAX_NAME), sha256(d, "tensor_digests"))
            for n, d in zip(a.tensor_names, a.tensor_digests, strict=True)
        )
    elif not a.digest:
        raise InvalidArgument(
            "a RankAudit carries a digest, per-tensor digests, or both (or is a step mark)"
        )
    return None


def _audit(a: pb.RankAudit, limits: Limits, seen: Seen) -> tuple[RankAudit | None, Beat]:
    if not 0 < a.world_size <= limits.max_world_size:
        raise InvalidArgument(
            f"world_size {a.world_size} is outside 1..{limits.max_world_size} (--max-world-size)"
        )
    if a.rank >= a.world_size:
        raise InvalidArgument(f"rank {a.rank} is outside the world size {a.world_size}")
    if a.step >= 1 << 62:
        raise InvalidArgument(f"step {a.step} is past 2^62")
    if a.digest and a.digest_format != DIGEST_FORMAT_VERSION:
        raise FailedPrecondition(
            f"digest_format {a.digest_format} is not {DIGEST_FORMAT_VERSION} "
            "(cohortgate.digest.v2): upgrade the agent or the coordinator so that both agree"
        )
    tensors = _tensors(a, limits)
    cohort_id = seen.text(a.cohort_id, "cohort_id", 128, required=True)
    job_id = seen.text(a.job_id, "job_id", MAX_JOB_ID, required=True)
    if not cohort_id.startswith(f"{job_id}/{a.round}/"):
        # A cohort id is JOB/ROUND/HASH: one job's audits never touch another job's cohort.
        raise InvalidArgument(
            f"cohort_id {cohort_id[:64]!r} is not a cohort of job {job_id[:64]!r} round "
            f"{a.round} (JOB/ROUND/HASH, as the formed verdict gave it)"
        )
    host = seen.text(a.host, "host")
    incarnation = text(a.incarnation, "incarnation", 128)
    beat = Beat(
        cohort_id=cohort_id,
        job_id=job_id,
        round=a.round,
        rank=a.rank,
        world_size=a.world_size,
        host=host,
        incarnation=incarnation,
        step=a.step,
        step_age_s=_seconds(a.step_age_s, "step_age_s"),
        paused=text(a.paused, "paused", MAX_FRAME_TEXT),
        paused_s=_seconds(a.paused_s, "paused_s"),
        done=a.done,
        stall_id=a.stall_id,
        snapshot=_snapshot(a.snapshot) if a.HasField("snapshot") else None,
    )
    if a.step_only:
        return None, beat
    audit = RankAudit(
        cohort_id=cohort_id,
        job_id=job_id,
        round=a.round,
        rank=a.rank,
        world_size=a.world_size,
        host=host,
        incarnation=incarnation,
        step=a.step,
        digest=sha256(a.digest, "digest", optional=True),
        group=seen.text(a.group, "group"),
        tensors=tensors,
        truncated=a.tensors_truncated,
    )
    return audit, beat
