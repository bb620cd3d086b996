"""The cohort as the decision sees it: members, the signature index, classes and launches."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from coordinator.contract import ranges
from coordinator.contract.fingerprint import Fields
from coordinator.contract.layout import Layout
from coordinator.contract.manifest import ManifestLike


class UploadKind(enum.StrEnum):
    """What a rank is asked to upload, keyed by what it joined with."""

    MANIFEST = "manifest"  # keyed by signature
    DIGESTS = "digests"  # per-tensor digests, keyed by weights digest


# What an invalid upload of each kind failed to match, for reasons and reports.
INVALID_UPLOAD = {
    UploadKind.MANIFEST: "uploaded manifest(s) did not hash to the signature their rank "
    "joined with",
    UploadKind.DIGESTS: "uploaded per-tensor digest list(s) did not combine to the weights "
    "digest their rank joined with",
}


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
    weights_digest: bytes = b""  # agent.join(verify_values=True); b"": not sent
    launch: str = ""  # which launch of the job (torchrun's store endpoint); "": unknown
    restart_count: int = 0  # torchrun's restart count: a torchrun restart raises it
    sharded_without_layout: bool = False  # DTensor parameters, no layout declared
    # What the job must agree on beyond parameters (see contract.fingerprint): check name
    # ("config", "code", "facts") -> the rank's fields; a name absent: not sent.
    agreed: Mapping[str, Fields] = field(default_factory=dict)
    joined_at: float = 0.0
    last_seen: float = 0.0


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

    def remove(self, member: Member, now: float) -> None:
        if self.members.get(member.rank) is not member:
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
            departures=list(self.departures),
            launches=dict(self.launches),
            intruders=list(self.intruders),
        )


class Outcome(enum.StrEnum):
    WAITING = "waiting"
    FORMED = "formed"
    REFUSED = "refused"


class Cause(enum.StrEnum):
    SIGNATURE_MISMATCH = "signature_mismatch"
    DEADLINE = "deadline"
    MANIFEST_INVALID = "manifest_invalid"
    LAYOUT = "layout"
    RUNTIME = "runtime"
    WEIGHTS = "weights"
    LAUNCH = "launch"
    CONFIG = "config"
    CODE = "code"
    FACTS = "facts"


@dataclass(frozen=True)
class SignatureClass:
    """Ranks sharing one signature; the reference class is the one others are diffed against."""

    signature: bytes
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    manifest_entries: int
    reference: bool = False
    group: str = ""  # the replica group ("tp=1 pp=0 ...") under a layout; "" otherwise

    @property
    def ranks_text(self) -> str:
        return ranges.compress(self.ranks)


@dataclass(frozen=True)
class LaunchGroup:
    """The ranks of one launch of a job that joined a cohort (intruders included)."""

    launch: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]


def launch_groups(cohort: CohortState) -> tuple[LaunchGroup, ...]:
    """Each known launch with its ranks, in the order of their lowest rank."""
    by: dict[str, list[Member]] = {}
    for m in [*cohort.members.values(), *cohort.intruders]:
        if m.launch:
            by.setdefault(m.launch, []).append(m)
    groups = [
        LaunchGroup(
            launch,
            tuple(sorted({m.rank for m in ms})),
            tuple(sorted({m.host for m in ms})),
        )
        for launch, ms in by.items()
    ]
    return tuple(sorted(groups, key=lambda g: (g.ranks[0], g.launch)))


def signature_classes(cohort: CohortState) -> tuple[SignatureClass, ...]:
    """Every class, reference first (the largest; ties go to the one holding the lowest rank),
    then the others in the order of their lowest rank."""
    return _classes(cohort, cohort.classes, "")


def _classes(
    cohort: CohortState, classes: dict[bytes, set[int]], group: str
) -> tuple[SignatureClass, ...]:
    built = []
    for signature, rank_set in classes.items():
        ranks = tuple(sorted(rank_set))
        hosts = tuple(sorted({cohort.members[r].host for r in ranks}))
        entries = cohort.members[ranks[0]].manifest_entries
        built.append(SignatureClass(signature, ranks, hosts, entries, group=group))
    built.sort(key=lambda c: (-len(c.ranks), c.ranks[0]))
    reference = built[0]
    others = sorted(built[1:], key=lambda c: c.ranks[0])
    return (
        SignatureClass(
            reference.signature,
            reference.ranks,
            reference.hosts,
            reference.manifest_entries,
            reference=True,
            group=group,
        ),
        *others,
    )


def replica_classes(cohort: CohortState) -> tuple[SignatureClass, ...]:
    """Under a layout: the signature classes of each replica group (ranks at one shard
    position, differing only in dp), for the groups holding more than one signature."""
    groups: dict[tuple[int, ...], dict[bytes, set[int]]] = {}
    labels: dict[tuple[int, ...], str] = {}
    for rank, m in cohort.members.items():
        assert m.layout is not None
        key = m.layout.replica_key
        labels[key] = m.layout.replica_label
        groups.setdefault(key, {}).setdefault(m.signature, set()).add(rank)
    out: list[SignatureClass] = []
    for key in sorted(groups, key=lambda k: min(r for s in groups[k].values() for r in s)):
        if len(groups[key]) > 1:
            out += _classes(cohort, groups[key], labels[key])
    return tuple(out)


def weight_classes(cohort: CohortState) -> dict[str, dict[bytes, list[int]]]:
    """Per replica group (its label; "" for all ranks when no layout is declared): weight
    digest -> ranks holding it, for ranks that sent one."""
    groups: dict[str, dict[bytes, list[int]]] = {}
    for rank in sorted(cohort.members):
        m = cohort.members[rank]
        if not m.weights_digest:
            continue
        label = m.layout.replica_label if m.layout is not None else ""
        groups.setdefault(label, {}).setdefault(m.weights_digest, []).append(rank)
    return groups
