"""What a decision says, as data: the decision, the verdict every rank receives, and the
pieces they are made of. Nothing here decides: the state layer stores these (and may import
this module); `formation`, `report` and the checks make them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.diff import ManifestDiff


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


class Level(enum.StrEnum):
    STRICT = "strict"  # a finding refuses the cohort
    WARN = "warn"  # the cohort forms; the finding is recorded and sent to every rank
    OFF = "off"  # the check does not run


@dataclass(frozen=True)
class Finding:
    check: str
    level: Level
    text: str
    ranks: tuple[int, ...] = ()


def warnings(findings: Iterable[Finding]) -> list[str]:
    """The warn findings as the lines a formed cohort's ranks (and the log) receive."""
    return [f"{f.check}: {f.text}" for f in findings if f.level is Level.WARN]


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
    # Modules fields whose code file lists the decision waits for (WAITING only).
    awaiting_files: tuple[bytes, ...] = ()
    findings: tuple[Finding, ...] = ()
    launches: tuple[LaunchGroup, ...] = ()
    weights: str = ""  # a weights refusal's kind: values | unsent | buffers | sharded
    # REFUSED only: the name of the check (or formation's gate) that refused, whose words
    # the report uses (report.WORDS)
    check: str = ""
    # WAITING only: the next moment this decision can change by itself, with nothing
    # joining, leaving or uploading (the join deadline, or the upload timeout once every
    # rank is in); the caller decides again then. None when decided.
    recheck_at: float | None = None

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(warnings(self.findings))


DiffKey = tuple[str, bytes]  # (replica group, signature)


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    job_id: str
    round: int
    cohort_id: str
    world_size: int
    reason: str
    decided_at: float
    init_method: str = ""
    cause: Cause | None = None
    classes: tuple[SignatureClass, ...] = ()
    # (group, signature) -> diff against its group's reference; None without a manifest.
    diffs: dict[DiffKey, ManifestDiff | None] = field(default_factory=dict)
    findings: tuple[Finding, ...] = ()
    missing_ranks: tuple[int, ...] = ()
    present_ranks: tuple[int, ...] = ()
    report: str = ""
    # One line naming the culprit ranks first: what every rank prints and torchrun's Root
    # Cause shows before the report, whichever rank torchrun picks.
    headline: str = ""

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(warnings(self.findings))


@dataclass(frozen=True)
class AuditFinding:
    """One record: a divergence found, or ranks that sent no audit for a step in time."""

    job_id: str
    cohort_id: str
    step: int
    kind: str  # "diverged" | "missing"
    level: str
    headline: str
    report: str
    at: float
    stop_step: int = 0
