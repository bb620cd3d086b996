"""The formation decision: one pure function of (cohort, now, options) -> decision + reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from coordinator.contract import ranges
from coordinator.contract.digests import differing
from coordinator.contract.layout import Layout
from coordinator.contract.manifest import Manifest
from coordinator.decision.checks import (
    OFF,
    STRICT,
    WARN,
    Finding,
    Policies,
    layout_findings,
    runtime_findings,
)


@dataclass(frozen=True)
class FormationOptions:
    # 600 s: long enough for a slow node to pull its image and load data before joining,
    # short enough that a job with a dead node fails within a coffee break, not an hour.
    join_deadline_s: float = 600.0
    # Once every rank has joined, how long to wait for the manifests that explain a
    # mismatch before refusing without them (their uploaders were asked at join time).
    manifest_timeout_s: float = 30.0
    policies: Policies = field(default_factory=Policies)


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
    sharded_without_layout: bool = False  # DTensor parameters, no layout declared
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
    manifests: dict[bytes, Manifest] = field(default_factory=dict)
    # signature -> why its uploaded manifest was rejected (it did not hash to the signature)
    invalid_manifests: dict[bytes, str] = field(default_factory=dict)
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


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    reason: str
    cause: Cause | None = None
    classes: tuple[SignatureClass, ...] = ()
    missing_ranks: tuple[int, ...] = ()
    present_ranks: tuple[int, ...] = ()
    # Signatures whose manifests the decision still waits for (WAITING only).
    awaiting_manifests: tuple[bytes, ...] = ()
    # Weight digests whose per-tensor digests the decision waits for (WAITING only).
    awaiting_digests: tuple[bytes, ...] = ()
    detail: dict[str, Any] = field(default_factory=dict)
    findings: tuple[Finding, ...] = ()
    launches: tuple[LaunchGroup, ...] = ()

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(f"{f.check}: {f.text}" for f in self.findings if f.level == WARN)


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


def decide(cohort: CohortState, now: float, options: FormationOptions) -> Decision:
    """Formed, refused or still waiting, with a one-line reason in brackets."""
    n, joined = cohort.world_size, len(cohort.members)
    if len(cohort.launches) > 1 or cohort.intruders:
        # At once, not at completion: the ranks of the other launch would otherwise wait
        # on ALREADY_EXISTS, or two half-jobs would form one cohort and train together.
        groups = launch_groups(cohort)
        return Decision(
            Outcome.REFUSED,
            f"[ranks of {len(groups)} launches joined under one job id]",
            cause=Cause.LAUNCH,
            launches=groups,
            present_ranks=tuple(sorted(cohort.members)),
        )
    if joined < n:
        deadline = cohort.first_join_at + options.join_deadline_s
        if now < deadline:
            return Decision(Outcome.WAITING, f"[{joined}/{n} ranks joined]")
        missing = ranges.missing(cohort.members, n)
        return Decision(
            Outcome.REFUSED,
            f"[join deadline of {options.join_deadline_s:g}s passed with {joined}/{n} ranks "
            f"joined; missing ranks {ranges.compress(missing)}]",
            cause=Cause.DEADLINE,
            missing_ranks=tuple(missing),
            present_ranks=tuple(sorted(cohort.members)),
        )
    # Refused only once every rank is here, so that every rank hears why.
    if cohort.invalid_manifests:
        return Decision(
            Outcome.REFUSED,
            f"[{len(cohort.invalid_manifests)} uploaded manifest(s) did not hash to the "
            "signature their rank joined with]",
            cause=Cause.MANIFEST_INVALID,
            detail={"invalid_manifests": dict(cohort.invalid_manifests)},
        )
    classes = signature_classes(cohort)
    # Each class's manifest is checked against its signature before the verdict: for one
    # class that proves the signature is honest, for several it explains the difference.
    awaiting = tuple(c.signature for c in classes if c.signature not in cohort.manifests)
    complete_at = cohort.complete_at if cohort.complete_at is not None else now
    signatures = "1 signature" if len(classes) == 1 else f"{len(classes)} different signatures"
    if awaiting and now < complete_at + options.manifest_timeout_s:
        return Decision(
            Outcome.WAITING,
            f"[{n}/{n} ranks joined, {signatures}, waiting for {len(awaiting)} manifest(s)]",
            classes=classes,
            awaiting_manifests=awaiting,
        )
    levels = options.policies.for_job(cohort.job_id)
    findings = runtime_findings(cohort.members, levels)
    layouts = {r: m.layout for r, m in cohort.members.items() if m.layout is not None}
    if layouts:
        return _layered(cohort, layouts, levels, findings, awaiting, now, options)
    if levels["model"] != STRICT and len(classes) > 1:
        if levels["model"] == WARN:
            findings.append(Finding("model", WARN, f"{len(classes)} different signatures"))
        classes = classes[:1]
    if len(classes) == 1:
        unverified = ", manifest not verified" if awaiting else ""
        strict = [f for f in findings if f.level == STRICT]
        if strict:
            return _refuse_runtime(n, strict, findings)
        held = _weights_gate(cohort, now, options, levels, findings)
        if held is not None:
            return held
        return Decision(
            Outcome.FORMED,
            f"[{n}/{n} ranks joined, 1 signature{unverified}]",
            classes=classes,
            findings=tuple(findings),
        )
    return Decision(
        Outcome.REFUSED,
        f"[{n}/{n} ranks joined, {signatures}]",
        cause=Cause.SIGNATURE_MISMATCH,
        classes=classes,
        findings=tuple(findings),
    )


def _refuse_runtime(n: int, strict: list[Finding], findings: list[Finding]) -> Decision:
    return Decision(
        Outcome.REFUSED,
        f"[{n}/{n} ranks joined; runtimes disagree: {', '.join(f.check for f in strict)}]",
        cause=Cause.RUNTIME,
        findings=tuple(findings),
    )


def _layered(
    cohort: CohortState,
    layouts: dict[int, Layout],
    levels: dict[str, str],
    findings: list[Finding],
    awaiting: tuple[bytes, ...],
    now: float,
    options: FormationOptions,
) -> Decision:
    """A sharded cohort: placement and coverage first, then one signature per replica group."""
    n = cohort.world_size
    findings += layout_findings(cohort.members, layouts, n, levels)
    strict = [f for f in findings if f.level == STRICT and not f.check.startswith("runtime")]
    placed = len(layouts) == n and not any(
        f.check == "layout" and f.level == STRICT for f in findings
    )
    classes = replica_classes(cohort) if placed else ()
    if classes and levels["model"] != OFF:
        if levels["model"] == STRICT:
            strict.append(
                Finding(
                    "model",
                    STRICT,
                    f"{len({c.group for c in classes})} replica group(s) hold differing signatures",
                    tuple(r for c in classes for r in c.ranks),
                )
            )
        else:
            findings.append(Finding("model", WARN, "replica groups hold differing signatures"))
            classes = ()
    if strict:
        checks = sorted({f.check for f in strict})
        cause = Cause.SIGNATURE_MISMATCH if checks == ["model"] and classes else Cause.LAYOUT
        return Decision(
            Outcome.REFUSED,
            f"[{len(cohort.members)}/{n} ranks joined; layered identity: {', '.join(checks)}]",
            cause=cause,
            classes=classes,
            findings=tuple(findings + [f for f in strict if f not in findings]),
        )
    runtime_strict = [f for f in findings if f.level == STRICT]
    if runtime_strict:
        return _refuse_runtime(n, runtime_strict, findings)
    held = _weights_gate(cohort, now, options, levels, findings)
    if held is not None:
        return held
    unverified = ", manifest not verified" if awaiting else ""
    return Decision(
        Outcome.FORMED,
        f"[{n}/{n} ranks joined, {len(cohort.classes)} signature(s) across "
        f"{len({lay.replica_key for lay in layouts.values()})} replica groups{unverified}]",
        findings=tuple(findings),
    )


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


def _by_size(classes: dict[bytes, list[int]]) -> list[tuple[bytes, list[int]]]:
    """Reference first (the largest; ties to the lowest rank), then by lowest rank."""
    ordered = sorted(classes.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
    return [ordered[0], *sorted(ordered[1:], key=lambda kv: kv[1][0])]


NAMES_SHOWN = 10


def _weights_gate(
    cohort: CohortState,
    now: float,
    options: FormationOptions,
    levels: dict[str, str],
    findings: list[Finding],
) -> Decision | None:
    """The weights check, once everything else would form: None to go on and form (warn
    findings added), else WAITING for per-tensor digests or REFUSED."""
    level = levels["weights"]
    if level == OFF:
        return None
    n = cohort.world_size
    found: list[Finding] = []
    unsent = [r for r, m in cohort.members.items() if not m.weights_digest]
    if unsent:
        found.append(
            Finding(
                "weights",
                level,
                f"{len(unsent)} rank(s) {ranges.compress_capped(unsent)} sent no weight digest; "
                "call agent.join(model, verify_values=True) on every rank",
                tuple(unsent),
            )
        )
    awaiting: list[bytes] = []
    pairs = 0  # classes holding other weights than their group's reference
    # Every pair's differing tensors are known and all are buffers: computed from the model
    # config (rotary frequencies), not initialised from a seed.
    buffers_only = True
    for label, classes in weight_classes(cohort).items():
        if len(classes) < 2:
            continue
        where = f"replica group {label}: " if label else ""
        ordered = _by_size(classes)
        ref_digest, ref_ranks = ordered[0]
        reference = cohort.tensor_digests.get(ref_digest)
        signature = cohort.members[ref_ranks[0]].signature
        manifest = cohort.manifests.get(signature)
        buffers = (
            {e.name for e in manifest.entries if e.kind.value == "buffer"} if manifest else set()
        )
        for digest, ranks in ordered[1:]:
            pairs += 1
            other = cohort.tensor_digests.get(digest)
            hosts = sorted({cohort.members[r].host for r in ranks})
            who = (
                f"{where}{len(ranks)} rank(s) [{ranges.compress_capped(ranks)}] on "
                f"{', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''} hold other weights "
                f"than ranks [{ranges.compress_capped(ref_ranks)}]"
            )
            if reference is None or other is None or manifest is None:
                buffers_only = False
                awaiting += [d for d in (ref_digest, digest) if d not in cohort.tensor_digests]
                found.append(Finding("weights", level, who, tuple(ranks)))
                continue
            names = [e.name for e in manifest.entries]
            differ = differing(names, reference, other)
            buffers_only = buffers_only and bool(differ) and set(differ) <= buffers
            shown = ", ".join(f"'{x}'" for x in differ[:NAMES_SHOWN])
            more = f" and {len(differ) - NAMES_SHOWN} more" if len(differ) > NAMES_SHOWN else ""
            found.append(
                Finding(
                    "weights",
                    level,
                    f"{who}: {len(differ)} of {len(names)} tensors differ, first {shown}{more}",
                    tuple(ranks),
                )
            )
    wanted = tuple(dict.fromkeys(awaiting))
    complete_at = cohort.complete_at if cohort.complete_at is not None else now
    if wanted and now < complete_at + options.manifest_timeout_s:
        return Decision(
            Outcome.WAITING,
            f"[{n}/{n} ranks joined, weights differ, waiting for {len(wanted)} digest list(s)]",
            awaiting_digests=wanted,
        )
    findings += found
    if level == STRICT and found:
        if not pairs:
            kind, what = "unsent", "weight digests missing"
        elif any(m.sharded_without_layout and m.layout is None for m in cohort.members.values()):
            kind, what = "sharded", "sharded weights compared without a layout"
        elif buffers_only:
            kind, what = "buffers", "buffers differ (model config)"
        else:
            kind, what = "values", "weights differ"
        return Decision(
            Outcome.REFUSED,
            f"[{n}/{n} ranks joined, models match, {what}]",
            cause=Cause.WEIGHTS,
            findings=tuple(findings),
            detail={"weights": kind},
        )
    return None
