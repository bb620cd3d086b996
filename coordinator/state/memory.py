"""The in-memory cohort store: live jobs and their rounds, joins, departures, uploads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cohortgate.coordinator.contract.digests import DIGEST_BYTES, combine_uploaded, files_field
from cohortgate.coordinator.contract.errors import (
    AlreadyHeld,
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
    NotFound,
)
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.contract.manifest import HeldManifest, ManifestLike
from cohortgate.coordinator.decision.cohort import CohortState, Member, UploadKind, modules_key
from cohortgate.coordinator.decision.verdict import Decision, Outcome, Verdict
from cohortgate.coordinator.state.asks import UploadRef, key_of, uploaded
from cohortgate.coordinator.state.base import (
    CohortStore,
    InvalidUpload,
    JoinIntent,
    JoinResult,
    LiveCohort,
)

# The most one manifest entry takes on the wire (a 1,024-character name, 64 dimensions and
# strides, dtype, alias): an upload larger than its announced entries allow is refused
# before it is decoded.
MAX_ENTRY_WIRE_BYTES = 4096
UPLOAD_SLACK_BYTES = 64 * 1024

# A new incarnation of a decided round's member (same launch, same torchrun restart count,
# same model) that joins within this many seconds of the decision is its predecessor's
# successor: the process died as the round was decided and came straight back, and the
# other ranks have their verdict. It gets that verdict, so every rank of the round has one.
# Never a torchrun worker's: torchrun starts a new process of a rank only with its whole
# node, after a crash (raising the restart count) or when another node re-rendezvouses
# (keeping it), and either way the job forms a new round. A
# rank started without torchrun names no launch (a node supervisor, a container restart, a
# harness): its successor is a new process of the same rank on the same host. A harness
# that relaunches a whole job within the window names a launch of its own (as torchrun does).
SUCCESSOR_WINDOW_S = 10.0

# Decided rounds kept per job, so that a rank re-joining with its incarnation gets its
# verdict back; older rounds are forgotten (the history database keeps them for good).
ROUNDS_KEPT = 4


@dataclass
class Job:
    job_id: str
    current: LiveCohort
    rounds: dict[int, LiveCohort] = field(default_factory=dict)
    # incarnation -> round it took part in, for decided rounds still kept
    incarnations: dict[str, int] = field(default_factory=dict)
    # The newest decided round (or the history's last one): a re-join naming a round after
    # it names one that was abandoned, even once that round is forgotten.
    last_decided: int = 0


class MemoryStore(CohortStore):
    """Every job the coordinator holds, in memory. Not thread-safe: one event loop owns it."""

    def __init__(
        self,
        clock: Callable[[], float],
        last_round: Callable[[str], int] = lambda job_id: 0,
        limits: Limits | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.waiting_cohorts = 0
        self.waiting_ranks = 0
        self.manifest_bytes = 0  # upload bytes of the manifests held, across cohorts
        self.clock = clock
        # After a restart, a job's rounds continue from the history's last one.
        self.last_round = last_round
        self.jobs: dict[str, Job] = {}

    # -- joins -------------------------------------------------------------------------
    def join(self, intent: JoinIntent) -> JoinResult:
        now = self.clock()
        member = intent.member
        member.joined_at = member.last_seen = now
        # Checked before anything is created: a refused join must leave no trace.
        if member.rank >= intent.world_size:
            raise InvalidArgument(
                f"rank {member.rank} is outside [0, {intent.world_size}) for world size "
                f"{intent.world_size}"
            )
        job = self.jobs.get(intent.job_id)
        if job is not None:
            replay = self._replay(job, intent) or self._successor(job, intent, now)
            if replay is not None:
                return replay
        opened = job is None or job.current.settled
        self._check_limits(opened)
        job = self._round_for(job, intent, now)
        cohort = job.current
        state = cohort.state
        if intent.world_size != state.world_size:
            raise FailedPrecondition(
                f"world size {intent.world_size} disagrees with job '{job.job_id}' round "
                f"{state.round}, which has world size {state.world_size}; every rank of a "
                "job must be launched with the same WORLD_SIZE"
            )
        held = state.members.get(member.rank)
        if held is not None and held.incarnation != member.incarnation:
            if member.launch and held.launch and member.launch != held.launch:
                state.intruders.append(member)
                return JoinResult(cohort, member, intruder=True)
            raise AlreadyHeld(
                f"rank {member.rank} of job '{job.job_id}' round {state.round} is already held "
                f"by incarnation {held.incarnation} (host {held.host}, pid {held.pid}); this "
                f"join is from incarnation {member.incarnation} (host {member.host}, pid "
                f"{member.pid}). Two processes claim the same RANK: check the launcher."
            )
        if held is None:
            self.waiting_ranks += 1
        if opened:
            self.waiting_cohorts += 1
        state.add(member, now)
        # The first rank of each signature is asked for its manifest at once.
        cohort.asks.ask(state, UploadKind.MANIFEST, member.signature, prefer=member, now=now)
        return JoinResult(cohort, member, opened=opened)

    def _check_limits(self, opening: bool) -> None:
        if opening and self.waiting_cohorts >= self.limits.max_cohorts:
            raise LimitExceeded(
                f"{self.waiting_cohorts} cohorts are waiting, the limit max_cohorts="
                f"{self.limits.max_cohorts}; this join would open another"
            )
        if self.waiting_ranks >= self.limits.max_waiting_ranks:
            raise LimitExceeded(
                f"{self.waiting_ranks} ranks are waiting, the limit max_waiting_ranks="
                f"{self.limits.max_waiting_ranks}"
            )

    def _round_for(self, job: Job | None, intent: JoinIntent, now: float) -> Job:
        """The job with the round this join takes part in: its open one, or a new one."""
        if job is None:
            first = self.last_round(intent.job_id) + 1
            cohort = self._new_cohort(intent, first, now)
            job = Job(intent.job_id, cohort, {first: cohort}, last_decided=first - 1)
            self.jobs[intent.job_id] = job
        elif job.current.settled:
            self._check_round(job, intent.round, job.current.round + 1)
            cohort = self._new_cohort(intent, job.current.round + 1, now)
            job.current = cohort
            job.rounds[cohort.round] = cohort
            self._forget_old_rounds(job)
        else:
            self._check_round(job, intent.round, job.current.round)
        return job

    def _replay(self, job: Job, intent: JoinIntent) -> JoinResult | None:
        past_round = job.incarnations.get(intent.member.incarnation)
        if past_round is None:
            return None
        cohort = job.rounds[past_round]
        member = cohort.state.members.get(intent.member.rank)
        if member is None:
            return None
        return JoinResult(cohort, member, replayed=True)

    def _successor(self, job: Job, intent: JoinIntent, now: float) -> JoinResult | None:
        """The just-decided round's verdict for a successor of one of its members (see
        SUCCESSOR_WINDOW_S), or None: the join takes part in the open (or a new) round."""
        cohort, new = job.current, intent.member
        held = cohort.state.members.get(new.rank)
        decided_at = cohort.settled_at
        if (
            cohort.verdict is None
            or decided_at is None
            or now - decided_at > SUCCESSOR_WINDOW_S
            or held is None
            or new.elastic
            or (held.launch, held.restart_count) != (new.launch, new.restart_count)
            or (not held.launch and held.host != new.host)
            or (held.signature, held.weights_digest, held.layout, held.agreed)
            != (new.signature, new.weights_digest, new.layout, new.agreed)
        ):
            return None
        job.incarnations[new.incarnation] = cohort.round  # its own re-joins replay too
        return JoinResult(cohort, held, replayed=True, successor=True)

    def _check_round(self, job: Job, asked: int, open_round: int) -> None:
        """A join that names a round (a re-join after its call dropped) takes part in the
        open round unless a round since the one it names was decided: those ranks have
        their verdict. Every round since was abandoned (a flapping network drops all of a
        job's calls at once, again and again): the rank still belongs in the open round,
        however many rounds went by and were forgotten meanwhile."""
        if asked in (0, open_round) or job.last_decided < asked < open_round:
            return
        if asked < open_round:
            since = (job.rounds.get(r) for r in range(asked, open_round))
            over = next((c for c in since if c is not None and c.verdict is not None), None)
            outcome = over.verdict.outcome.value if over and over.verdict else "decided"
            raise FailedPrecondition(
                f"round {asked} of job '{job.job_id}' is over ({outcome}); the open round is "
                f"{open_round}. Join without a round to take part in it."
            )
        raise FailedPrecondition(
            f"round {asked} of job '{job.job_id}' does not exist yet; the open round is "
            f"{open_round}"
        )

    def _new_cohort(self, intent: JoinIntent, round_: int, now: float) -> LiveCohort:
        return LiveCohort(CohortState(intent.job_id, round_, intent.world_size, first_join_at=now))

    def _forget_old_rounds(self, job: Job) -> None:
        """The newest ROUNDS_KEPT rounds stay, counting no abandoned one but the open
        round: abandoned rounds (a flapping network makes many) never push out a verdict
        that its ranks' re-joins replay."""
        rounds = sorted(job.rounds)
        counted = [r for r in rounds if job.rounds[r].abandoned_at is None or r == rounds[-1]]
        keep = set(rounds[-ROUNDS_KEPT:]) | set(counted[-ROUNDS_KEPT:])
        old = [r for r in rounds if r not in keep]
        if not old:
            return
        for round_ in old:
            del job.rounds[round_]
        # Members' incarnations and their successors' (see _successor) alike.
        job.incarnations = {i: r for i, r in job.incarnations.items() if r in job.rounds}

    # -- departures --------------------------------------------------------------------
    def leave(self, cohort: LiveCohort, member: Member) -> list[Member]:
        """A rank's call dropped before the verdict: free its rank for a restarted process.

        Returns the members now asked for the uploads the one that left had been asked for
        and had not sent.
        """
        if cohort.verdict is not None:
            return []
        if cohort.state.holds(member):
            self.waiting_ranks -= 1
        cohort.state.remove(member, self.clock())
        return cohort.asks.hand_over(cohort.state, member)

    def abandon(self, cohort: LiveCohort) -> bool:
        """A waiting cohort whose every rank has left is abandoned at once: its slot is
        freed and the job's next join opens a fresh round (any world size), instead of
        a relaunch being refused until the deadline, then counted as a refusal."""
        if cohort.settled or cohort.state.members:
            return False
        cohort.abandoned_at = self.clock()
        self._drop_uploads(cohort)
        self.waiting_cohorts -= 1
        return True

    # -- uploads -----------------------------------------------------------------------
    def _member(self, ref: UploadRef, what: str) -> tuple[LiveCohort, Member]:
        """The cohort and member an upload of `what` comes from, or the error saying why not."""
        job = self.jobs.get(ref.job_id)
        cohort = job.rounds.get(ref.round) if job else None
        if job is None or cohort is None:
            raise NotFound(
                f"no round {ref.round} of job '{ref.job_id}' is held by this coordinator"
            )
        member = cohort.state.members.get(ref.rank)
        if member is None or member.incarnation != ref.incarnation:
            raise FailedPrecondition(
                f"rank {ref.rank} incarnation {ref.incarnation} is not a member of job "
                f"'{ref.job_id}' round {ref.round}: join before uploading {what}"
            )
        return cohort, member

    def _invalid(
        self, cohort: LiveCohort, kind: UploadKind, key: bytes, message: str
    ) -> InvalidUpload:
        cohort.state.invalid_uploads.setdefault((kind, key), message)
        cohort.asks.done(kind, key)
        return InvalidUpload(message, cohort)

    def wants_upload(self, ref: UploadRef, kind: UploadKind, claimed: bytes, size: int) -> bool:
        what = "a manifest" if kind is UploadKind.MANIFEST else "digests"
        cohort, member = self._member(ref, what)
        if kind is UploadKind.MANIFEST:
            self._check_claim(ref, member, claimed)
            most = member.manifest_entries * MAX_ENTRY_WIRE_BYTES + UPLOAD_SLACK_BYTES
        else:
            self._check_digests_expected(ref, member)
            most = member.manifest_entries * (DIGEST_BYTES + 8) + UPLOAD_SLACK_BYTES
        if size > most:
            raise LimitExceeded(
                f"the {what} upload of rank {ref.rank} is {size} bytes, more than its "
                f"{member.manifest_entries}-entry manifest can take ({most} bytes at most)"
            )
        wanted = not uploaded(cohort.state, kind, key_of(member, kind))
        if wanted and kind is UploadKind.MANIFEST:
            self._check_manifest_budget(cohort, size)
        return wanted

    def _check_manifest_budget(self, cohort: LiveCohort, size: int) -> None:
        limits = self.limits
        if cohort.manifest_bytes + size > limits.max_cohort_manifest_bytes:
            raise LimitExceeded(
                f"job '{cohort.job_id}' round {cohort.round} holds {cohort.manifest_bytes} "
                f"bytes of manifests; this {size}-byte upload would pass the limit "
                f"max_cohort_manifest_bytes={limits.max_cohort_manifest_bytes} (that many "
                "different models in one job is itself the problem: the cohort is refused "
                "with the manifests it has)"
            )
        if self.manifest_bytes + size > limits.max_manifest_bytes:
            raise LimitExceeded(
                f"this coordinator holds {self.manifest_bytes} bytes of manifests across all "
                f"cohorts; this {size}-byte upload would pass the limit "
                f"max_manifest_bytes={limits.max_manifest_bytes}"
            )

    def _check_claim(self, ref: UploadRef, member: Member, claimed: bytes) -> None:
        if claimed != member.signature:
            raise InvalidArgument(
                f"upload claims signature {claimed.hex()[:12]}, but rank {ref.rank} joined "
                f"with {member.signature.hex()[:12]}"
            )

    def _check_digests_expected(self, ref: UploadRef, member: Member) -> None:
        if not member.weights_digest:
            raise FailedPrecondition(
                f"rank {ref.rank} joined without a weights digest; there is nothing to explain"
            )

    def upload(
        self, ref: UploadRef, manifest: ManifestLike, claimed: bytes, size: int = 0
    ) -> LiveCohort:
        cohort, member = self._member(ref, "a manifest")
        rank = ref.rank
        self._check_claim(ref, member, claimed)
        actual = manifest.signature()
        if actual != claimed:
            message = (
                f"the manifest uploaded by rank {rank} (host {member.host}) hashes to "
                f"{actual.hex()[:12]}, not to the signature {claimed.hex()[:12]} it joined "
                "with: agent and coordinator disagree on the encoding, or the model changed "
                "between signing and uploading"
            )
            raise self._invalid(cohort, UploadKind.MANIFEST, claimed, message)
        if len(manifest) != member.manifest_entries:
            raise InvalidArgument(
                f"the manifest uploaded by rank {rank} has {len(manifest)} entries, but the "
                f"join announced {member.manifest_entries}"
            )
        if claimed not in cohort.state.manifests:
            held = manifest if isinstance(manifest, HeldManifest) else HeldManifest(manifest)
            cohort.state.manifests[claimed] = held
            cohort.manifest_bytes += size
            self.manifest_bytes += size
        cohort.asks.done(UploadKind.MANIFEST, claimed)
        return cohort

    def _drop_uploads(self, cohort: LiveCohort) -> None:
        """A settled cohort's manifests and digests go: the verdict holds what it needs."""
        self.manifest_bytes -= cohort.manifest_bytes
        cohort.manifest_bytes = 0
        cohort.state.manifests.clear()
        cohort.state.tensor_digests.clear()
        cohort.state.files.clear()

    # -- decisions ---------------------------------------------------------------------
    def apply(
        self, cohort: LiveCohort, decision: Decision, verdict: Verdict | None, now: float
    ) -> bool:
        if cohort.settled:
            return False
        if decision.outcome is Outcome.WAITING:
            # One representative per weights digest (its lowest rank) is asked for its list.
            for digest in decision.awaiting_digests:
                cohort.asks.ask(cohort.state, UploadKind.DIGESTS, digest, now=now)
            for key in decision.awaiting_files:
                cohort.asks.ask(cohort.state, UploadKind.FILES, key, now=now)
            return True
        assert verdict is not None, "a decided cohort comes with its verdict (judge)"
        cohort.verdict = verdict
        self._drop_uploads(cohort)
        self.waiting_cohorts -= 1
        self.waiting_ranks -= len(cohort.state.members)
        job = self.jobs[cohort.job_id]
        job.last_decided = max(job.last_decided, cohort.round)
        for m in cohort.state.members.values():
            job.incarnations[m.incarnation] = cohort.round
        return True

    def digests_manifest(self, ref: UploadRef, count: int) -> ManifestLike:
        return self._digests_source(ref, count)[2]

    def _digests_source(
        self, ref: UploadRef, count: int
    ) -> tuple[LiveCohort, Member, ManifestLike]:
        """The uploader's cohort and member, checked to be asked for `count` digests, and
        the manifest whose entries name them."""
        cohort, member = self._member(ref, "digests")
        self._check_digests_expected(ref, member)
        if count != member.manifest_entries:
            raise InvalidArgument(
                f"{count} digests uploaded, but rank {ref.rank}'s manifest has "
                f"{member.manifest_entries} entries: send one per entry, in manifest order"
            )
        manifest = cohort.state.manifests.get(member.signature)
        if manifest is None:
            raise FailedPrecondition(
                f"the manifest of rank {ref.rank}'s signature is not uploaded yet; digests are "
                "named by its entries"
            )
        return cohort, member, manifest

    def upload_digests(
        self, ref: UploadRef, digests: list[bytes], combined: bytes | None = None
    ) -> LiveCohort:
        cohort, member, manifest = self._digests_source(ref, len(digests))
        if combined is None:
            combined = combine_uploaded((e.name for e in manifest.entries), digests)
        if combined != member.weights_digest:
            message = (
                f"the per-tensor digests uploaded by rank {ref.rank} (host {member.host}) do "
                "not combine to the weights digest it joined with: the weights changed between "
                "digesting and uploading, or agent and coordinator versions differ"
            )
            raise self._invalid(cohort, UploadKind.DIGESTS, member.weights_digest, message)
        cohort.state.tensor_digests.setdefault(member.weights_digest, tuple(digests))
        cohort.asks.done(UploadKind.DIGESTS, member.weights_digest)
        return cohort

    def upload_files(self, ref: UploadRef, files: list[tuple[str, bytes]]) -> LiveCohort:
        cohort, member = self._member(ref, "code files")
        key = modules_key(member)
        if not key:
            raise FailedPrecondition(
                f"rank {ref.rank} joined without a modules field; there are no files to name"
            )
        cohort.asks.done(UploadKind.FILES, key)
        if files_field(files).encode() != key:
            cohort.state.files.setdefault(key, ())  # unknown: the report says so
            raise InvalidUpload(
                f"the code files uploaded by rank {ref.rank} (host {member.host}) do not "
                f"combine to the modules field it joined with ({key.decode()[:64]}): a file "
                "changed on disk since the join, or agent and coordinator versions differ",
                cohort,
            )
        cohort.state.files.setdefault(key, tuple(files))
        return cohort

    def rotate_asks(self, cohort: LiveCohort, after_s: float) -> list[Member]:
        if cohort.settled:
            return []
        return cohort.asks.rotate(cohort.state, self.clock(), after_s)

    def holds(self, job_id: str) -> bool:
        return job_id in self.jobs

    def find(self, job_id: str, round_: int = 0) -> LiveCohort | None:
        job = self.jobs.get(job_id)
        if job is None:
            return None
        return job.current if round_ == 0 else job.rounds.get(round_)

    def cohorts(self, job_id: str = "") -> list[LiveCohort]:
        jobs = self.jobs
        selected = [jobs[job_id]] if job_id in jobs else [] if job_id else list(jobs.values())
        return [c for job in selected for _, c in sorted(job.rounds.items())]

    def evict(self, older_than_s: float) -> int:
        """Forget jobs decided longer ago than `older_than_s` (history keeps their verdicts),
        so a coordinator serving job after job holds a bounded number of them."""
        now = self.clock()
        stale = [
            job_id
            for job_id, job in self.jobs.items()
            if (settled := job.current.settled_at) is not None and now - settled > older_than_s
        ]
        for job_id in stale:
            del self.jobs[job_id]
        return len(stale)
