"""The cohort as the decision sees it: members, the signature index, uploads and launches
(data, changed only through `add` and `remove`)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from cohortgate.coordinator.contract.fingerprint import Fields
from cohortgate.coordinator.contract.layout import Layout
from cohortgate.coordinator.contract.manifest import ManifestLike


class UploadKind(enum.StrEnum):
    """What a rank is asked to upload, keyed by what it joined with."""

    MANIFEST = "manifest"  # keyed by signature
    DIGESTS = "digests"  # per-tensor digests, keyed by weights digest
    FILES = "files"  # local code files, keyed by the `code` fingerprint's modules field


# What an invalid upload of each kind failed to match, for reasons and reports.
INVALID_UPLOAD = {
    UploadKind.MANIFEST: "uploaded manifest(s) did not hash to the signature their rank "
    "joined with",
    UploadKind.DIGESTS: "uploaded per-tensor digest list(s) did not combine to the weights "
    "digest their rank joined with",
    UploadKind.FILES: "uploaded code file list(s) did not combine to the modules field their "
    "rank joined with",
}


def modules_key(member: Member) -> bytes:
    """The `modules` field of a member's `code` fingerprint (its local code files in one
    digest), as the key of its FILES uploads; b"" when it sent none."""
    for name, value in member.agreed.get("code", ()):
        if name == "modules":
            return value.encode()
    return b""


@dataclass
class Member:
    """One rank's join, as the coordinator holds it while the cohort forms."""

    rank: int
    host: str
    pid: int
    incarnation: str
    signature: bytes
    manifest_entries: int
    local_rank: int = 0
    init_method: str = ""
    runtime: dict[str, str] = field(default_factory=dict)
    layout: Layout | None = None
    weights_digest: bytes = b""  # cohortgate.join(verify_values=True); b"": not sent
    launch: str = ""  # which launch of the job (torchrun's store endpoint); "": unknown
    restart_count: int = 0  # torchrun's restart count: a torchrun restart raises it
    elastic: bool = False  # a torchrun worker: a new process of it is never a successor
    sharded_without_layout: bool = False  # DTensor parameters, no layout declared
    # What the job must agree on beyond parameters (see contract.fingerprint): check name
    # ("config", "code", "facts") -> the rank's fields; a name absent: not sent.
    agreed: Mapping[str, Fields] = field(default_factory=dict)
    joined_at: float = 0.0
    last_seen: float = 0.0

    def twin(self, rank: int, local_rank: int, host: str, pid: int, incarnation: str) -> Member:
        """The same join sent by another rank of its class (a relay's `RankClass`): what
        they share is shared (never changed once joined), not copied field by field."""
        twin: Member = object.__new__(Member)
        fields = self.__dict__.copy()
        fields.update(rank=rank, local_rank=local_rank, host=host, pid=pid, incarnation=incarnation)
        twin.__dict__ = fields
        return twin


@dataclass
class Departure:
    rank: int
    host: str
    incarnation: str
    at: float


@dataclass
class CohortState:
    """A (job, round) while it forms; members and the signature index change only here."""

    job_id: str
    round: int
    world_size: int
    first_join_at: float
    members: dict[int, Member] = field(default_factory=dict)
    # signature -> ranks holding it, kept up to date so a decision never regroups N ranks.
    classes: dict[bytes, set[int]] = field(default_factory=dict)
    manifests: dict[bytes, ManifestLike] = field(default_factory=dict)
    # (kind, key) -> why an upload was rejected: a manifest that did not hash to its
    # signature, per-tensor digests that did not combine to their weights digest
    invalid_uploads: dict[tuple[UploadKind, bytes], str] = field(default_factory=dict)
    # weights digest -> per-tensor digests (verified against it), fetched on disagreement
    tensor_digests: dict[bytes, tuple[bytes, ...]] = field(default_factory=dict)
    # modules field -> (path, digest) of each local code file, fetched when ranks differ
    files: dict[bytes, tuple[tuple[str, bytes], ...]] = field(default_factory=dict)
    complete_at: float | None = None
    last_join_at: float = 0.0
    departures: list[Departure] = field(default_factory=list)
    # Bumped on every membership change; lets callers cache what they derive from members.
    version: int = 0
    # launch -> members of it (only known launches), kept so a conflict costs O(1) to see
    launches: dict[str, int] = field(default_factory=dict)
    # joins of another launch for a rank a member already holds: never members, they
    # refuse the cohort and are named in its report
    intruders: list[Member] = field(default_factory=list)

    def add(self, member: Member, now: float) -> None:
        old = self.members.get(member.rank)
        if old is not None:
            self._unindex(old)
        self.members[member.rank] = member
        self.last_join_at = now
        self.version += 1
        self.classes.setdefault(member.signature, set()).add(member.rank)
        if member.launch:
            self.launches[member.launch] = self.launches.get(member.launch, 0) + 1
        if len(self.members) == self.world_size and self.complete_at is None:
            self.complete_at = now

    def holds(self, member: Member) -> bool:
        """Is `member` (its rank and incarnation: not another launch's intruder, nor a
        process that took its rank since) a member now?"""
        held = self.members.get(member.rank)
        return held is not None and held.incarnation == member.incarnation

    def remove(self, member: Member, now: float) -> None:
        if not self.holds(member):
            return
        del self.members[member.rank]
        self.version += 1
        self._unindex(member)
        self.complete_at = None
        self.departures.append(Departure(member.rank, member.host, member.incarnation, now))

    def _unindex(self, member: Member) -> None:
        if member.launch:
            left = self.launches.pop(member.launch, 0) - 1
            if left > 0:
                self.launches[member.launch] = left
        ranks = self.classes.get(member.signature)
        if ranks is not None:
            ranks.discard(member.rank)
            if not ranks:
                del self.classes[member.signature]

    @property
    def complete(self) -> bool:
        return len(self.members) == self.world_size

    @property
    def pieces(self) -> int:
        """Layout pieces declared by the members: what the coverage check walks."""
        return sum(len(m.layout.pieces) for m in self.members.values() if m.layout is not None)

    def fingerprint(self) -> tuple[int, ...]:
        """Changes whenever anything a decision reads changes (membership and uploads)."""
        return (
            self.version,
            len(self.manifests),
            len(self.tensor_digests),
            len(self.invalid_uploads),
            len(self.intruders),
        )

    def snapshot(self) -> CohortState:
        """A copy a worker thread can decide on while the loop goes on changing this one
        (members, layouts and manifests themselves are not changed once added)."""
        return dataclasses.replace(
            self,
            members=dict(self.members),
            classes={k: set(v) for k, v in self.classes.items()},
            manifests=dict(self.manifests),
            invalid_uploads=dict(self.invalid_uploads),
            tensor_digests=dict(self.tensor_digests),
            files=dict(self.files),
            departures=list(self.departures),
            launches=dict(self.launches),
            intruders=list(self.intruders),
        )


@dataclass(frozen=True)
class Ask:
    """Rank `rank` (incarnation `incarnation`) is to upload `kind` for the class `key`."""

    kind: UploadKind
    key: bytes  # the class: a signature (manifest), a weights digest, a modules field
    rank: int
    incarnation: str
    at: float = 0.0  # when this rank was asked


@dataclass
class AskBook:
    """The open asks of one cohort (data; decision/asks.py says who is asked): at most one
    per (kind, class), held by a live member."""

    open: dict[tuple[UploadKind, bytes], Ask] = field(default_factory=dict)
    # Bumped whenever an ask is handed to a member: a waiting call rescans its members'
    # asks only then, not on every wake-up (16k ranks' wake-ups made that a fifth of the
    # loop's time).
    made: int = 0
