"""The state interface: where live cohorts are held, and where verdicts are kept.

The service talks to a `CohortStore` (its rules, service/cohorts.py, over a `CohortData`:
jobs by id, `memory.MemoryCohorts`) and a `VerdictStore` (in memory, SQLite or etcd); a
durable or replicated store implements `CohortData` or `VerdictStore`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.errors import InvalidArgument
from cohortgate.coordinator.contract.manifest import ManifestLike
from cohortgate.coordinator.decision.cohort import AskBook, CohortState, Member, UploadKind
from cohortgate.coordinator.decision.verdict import AuditFinding, Decision, Verdict
from cohortgate.coordinator.state.asks import UploadRef


class InvalidUpload(InvalidArgument):
    """An upload that does not match what its rank joined with; the cohort is refused."""

    def __init__(self, message: str, cohort: LiveCohort) -> None:
        super().__init__(message)
        self.cohort = cohort


@dataclass
class JoinIntent:
    """A validated join, in domain terms."""

    job_id: str
    round: int  # 0: the open round
    member: Member
    world_size: int
    quiet: bool = False  # only the first progress event (JoinRequest.quiet)


@dataclass
class LiveCohort:
    """A (job, round): its forming state, then its verdict."""

    state: CohortState
    verdict: Verdict | None = None
    # who is asked for which upload (manifests at join, per-tensor digests on demand)
    asks: AskBook = field(default_factory=AskBook)
    abandoned_at: float | None = None  # every rank left before a verdict
    manifest_bytes: int = 0  # upload bytes of the manifests held (see Limits)

    # (state version or -1 once decided, the missing ranks as text): status reads are O(1)
    _missing: tuple[int, str] = (-2, "")

    def missing_text(self) -> str:
        """The missing ranks, compressed and capped; recomputed only when membership changes
        (O(joined), never O(world size))."""
        key = -1 if self.verdict is not None else self.state.version
        if self._missing[0] != key:
            if self.verdict is not None:
                text = ranges.compress_capped(self.verdict.missing_ranks)
            else:
                text = ranges.missing_text(self.state.members, self.state.world_size)
            self._missing = (key, text)
        return self._missing[1]

    @property
    def settled(self) -> bool:
        """Decided or abandoned: the job's next join opens a new round."""
        return self.verdict is not None or self.abandoned_at is not None

    @property
    def settled_at(self) -> float | None:
        if self.verdict is not None:
            return self.verdict.decided_at
        return self.abandoned_at

    @property
    def job_id(self) -> str:
        return self.state.job_id

    @property
    def round(self) -> int:
        return self.state.round


@dataclass
class JoinResult:
    cohort: LiveCohort
    member: Member
    replayed: bool = False  # a decided round's verdict handed back to the same incarnation
    # ... or to a successor: a new incarnation of a member, of the same launch and torchrun
    # generation, that came back as the round was decided (see decision/admit.py: is_successor)
    successor: bool = False
    opened: bool = False  # this join opened the cohort (a new round)
    intruder: bool = False  # of another launch, for a rank held: refuses the cohort


@dataclass(frozen=True)
class VerdictRow:
    cohort_id: str
    job_id: str
    round: int
    outcome: str
    cause: str
    reason: str
    report: str
    world_size: int
    decided_at: float
    # Written with the verdict (rank -> incarnation, for replay); a listing leaves both out,
    # a single row read (get) leaves out the verdict.
    members: dict[int, str] = field(default_factory=dict)
    verdict: Verdict | None = None

    @classmethod
    def of(cls, verdict: Verdict, members: dict[int, str]) -> VerdictRow:
        """The row recorded for `verdict`; `members`: rank -> incarnation, for replay."""
        return cls(
            cohort_id=verdict.cohort_id,
            job_id=verdict.job_id,
            round=verdict.round,
            outcome=verdict.outcome.value,
            cause=verdict.cause.value if verdict.cause else "none",
            reason=verdict.reason,
            report=verdict.report,
            world_size=verdict.world_size,
            decided_at=verdict.decided_at,
            members=members,
            verdict=verdict,
        )


@dataclass
class Job:
    """A job the coordinator holds: its open (or last) round and the decided rounds kept."""

    job_id: str
    current: LiveCohort
    rounds: dict[int, LiveCohort] = field(default_factory=dict)
    # incarnation -> round it took part in, for decided rounds still kept
    incarnations: dict[str, int] = field(default_factory=dict)
    # The newest decided round (or the history's last one): a re-join naming a round after
    # it names one that was abandoned, even once that round is forgotten.
    last_decided: int = 0


class CohortData(abc.ABC):
    """Where the live jobs are kept, by id: data only, no rule (the service's `Cohorts`
    applies the rules to it). Live cohorts stay in the leading coordinator's memory (a
    backend need not persist them: see ARCHITECTURE.md, A second state backend); `get`
    returns the live object, whose later changes show through it."""

    @abc.abstractmethod
    def get(self, job_id: str) -> Job | None: ...

    @abc.abstractmethod
    def put(self, job: Job) -> None:
        """Keep `job` (a new one, or the same object again)."""

    @abc.abstractmethod
    def drop(self, job_id: str) -> None:
        """Forget the job (nothing if it is not held)."""

    @abc.abstractmethod
    def jobs(self) -> list[Job]:
        """Every job held, in the order they were first kept."""


class CohortStore(abc.ABC):
    """Live cohorts: joins, departures, uploads and decisions, one round at a time per job."""

    waiting_cohorts: int
    waiting_ranks: int

    @abc.abstractmethod
    def join(self, intent: JoinIntent, asked: set[bytes] | None = None) -> JoinResult:
        """Admit a rank to its job's open round (opening one), or say why not. `asked`: the
        signatures whose manifest ask the call's earlier ranks ensured (this one adds its
        own)."""

    @abc.abstractmethod
    def join_next(self, first: JoinResult, intent: JoinIntent, asked: set[bytes]) -> JoinResult:
        """Another rank of the call whose first rank joined as `first`: as `join`, without
        looking up again what the call's ranks share."""

    @abc.abstractmethod
    def leave(self, cohort: LiveCohort, member: Member) -> list[Member]:
        """A rank left before the verdict; returns the members newly asked for uploads."""

    @abc.abstractmethod
    def abandon(self, cohort: LiveCohort) -> bool:
        """Abandon a waiting round that every rank left; False if it is not one."""

    @abc.abstractmethod
    def wants_upload(self, ref: UploadRef, kind: UploadKind, claimed: bytes, size: int) -> bool:
        """Decided before an upload's payload is decoded: raises when `ref` is no member (or
        claims another signature, or sends more bytes than its manifest can take); False
        when the upload is already in (nothing to decode)."""

    @abc.abstractmethod
    def upload(
        self, ref: UploadRef, manifest: ManifestLike, claimed: bytes, size: int = 0
    ) -> LiveCohort:
        """A manifest upload, checked against its signature (InvalidUpload if it lies)."""

    @abc.abstractmethod
    def digests_manifest(self, ref: UploadRef, count: int) -> ManifestLike:
        """The manifest whose entries name `ref`'s `count` digests (checks that they were
        asked, and are as many as its entries)."""

    @abc.abstractmethod
    def upload_digests(
        self, ref: UploadRef, digests: list[bytes], combined: bytes | None = None
    ) -> LiveCohort:
        """Per-tensor digests, checked against the weights digest (InvalidUpload if not);
        `combined`: their combination, when the caller computed it off the event loop."""

    @abc.abstractmethod
    def upload_files(self, ref: UploadRef, files: list[tuple[str, bytes]]) -> LiveCohort:
        """A rank's local code files (path, digest), checked against the modules field it
        joined with; one that does not match is kept as unknown (the report cannot name
        the files) and raises InvalidUpload, without refusing the cohort for it."""

    @abc.abstractmethod
    def apply(
        self, cohort: LiveCohort, decision: Decision, verdict: Verdict | None, now: float
    ) -> bool:
        """Keep what the service's decision (made at `now`) says: WAITING asks one rank per
        awaited weights digest for its per-tensor digests; FORMED or REFUSED makes `verdict`
        the cohort's, frees its uploads and remembers its members' incarnations for replay.
        False (and nothing kept) when the cohort was settled meanwhile."""

    @abc.abstractmethod
    def rotate_asks(self, cohort: LiveCohort, after_s: float) -> list[Member]:
        """Asks unanswered for `after_s` go to another rank of their class; returns the
        members newly asked."""

    @abc.abstractmethod
    def holds(self, job_id: str) -> bool: ...

    @abc.abstractmethod
    def find(self, job_id: str, round_: int = 0) -> LiveCohort | None:
        """A round of a job (0: its current one)."""

    @abc.abstractmethod
    def cohorts(self, job_id: str = "") -> list[LiveCohort]:
        """Every cohort held (waiting and recently decided), optionally of one job."""

    @abc.abstractmethod
    def evict(self, older_than_s: float) -> int:
        """Forget jobs settled longer ago than `older_than_s`; returns how many went."""


ErrorListener = Callable[[str, Exception], None]  # (operation, error)


class VerdictStore(abc.ABC):
    """Verdicts kept after their cohort leaves memory, across restarts. A record, never a
    gate: `record` never blocks or raises; failures go to `listeners` and `problem`."""

    listeners: list[ErrorListener]

    @property
    @abc.abstractmethod
    def problem(self) -> str:
        """Why the store is degraded ("" when it is not)."""

    @property
    def fenced(self) -> bool:
        """True where a verdict must be stored before it is sent, with no fallback (etcd: a
        replica whose write fails no longer leads). False: a degraded or slow store is a
        record, not a gate (SQLite)."""
        return False

    @property
    @abc.abstractmethod
    def spooled(self) -> int:
        """Verdicts recorded but not yet stored."""

    @abc.abstractmethod
    def record(self, row: VerdictRow, written: Callable[[], None] | None = None) -> None:
        """Queue `row`; `written` is called (from any thread) once it is stored, and never
        if it cannot be."""

    @abc.abstractmethod
    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every recorded verdict is stored; False if it could not be in time."""

    @abc.abstractmethod
    def get(self, job_id: str, round_: int = 0) -> VerdictRow | None:
        """The verdict of (job, round); round 0: the job's latest."""

    @abc.abstractmethod
    def recent(self, limit: int = 20, job_id: str = "") -> list[VerdictRow]: ...

    @abc.abstractmethod
    def verdict_of(self, job_id: str, incarnation: str, rounds: int = 4) -> Verdict | None:
        """The verdict a rank's incarnation received in one of the job's recent rounds."""

    @abc.abstractmethod
    def last_round(self, job_id: str) -> int: ...

    @abc.abstractmethod
    def record_audit(self, finding: AuditFinding) -> None:
        """Queue an audit finding (a divergence, ranks that sent no audit); never blocks."""

    @abc.abstractmethod
    def audits(self, job_id: str, limit: int = 200) -> list[AuditFinding]:
        """The job's audit findings, oldest first (the newest `limit`)."""

    @abc.abstractmethod
    def close(self) -> None: ...
