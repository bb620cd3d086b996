"""Servicer-side proto -> domain: join requests and uploads validated into intents, refs,
manifests and digests. (Replies out are `replies`; the agent-safe part is `codec.wire`.)"""

from __future__ import annotations

from google.protobuf.message import Message

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec.wire import (
    DEFAULT_LIMITS,
    MAX_JOB_ID,
    MAX_NAME,
    manifest_from_pb,
    sha256,
    text,
)
from cohortgate.coordinator.contract.digests import DIGEST_FORMAT_VERSION, MAX_FILE_PATH, MAX_FILES
from cohortgate.coordinator.contract.errors import (
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
)
from cohortgate.coordinator.contract.limits import MAX_AUDITS_PER_CALL, Limits
from cohortgate.coordinator.contract.manifest import HeldManifest
from cohortgate.coordinator.decision.audit import RankAudit
from cohortgate.coordinator.decision.stall import Beat, Snapshot
from cohortgate.coordinator.edge.joins import Seen
from cohortgate.coordinator.edge.plumbing import parsed
from cohortgate.coordinator.state.asks import UploadRef


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
    head: pb.UploadManifestHeader = parsed(pb.UploadManifestHeader, _front(data, fields), sent)
    return head


def manifest_of(data: bytes, limits: Limits = DEFAULT_LIMITS) -> HeldManifest:
    """The whole upload decoded, validated, hashed and compacted (in a worker thread when
    large: O(entries)); the event loop only compares its signature and length."""
    req: pb.UploadManifestRequest = parsed(pb.UploadManifestRequest, data)
    return HeldManifest(manifest_from_pb(req.manifest, limits))


def digests_of(data: bytes, limits: Limits = DEFAULT_LIMITS) -> list[bytes]:
    req: pb.UploadDigestsRequest = parsed(pb.UploadDigestsRequest, data)
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
