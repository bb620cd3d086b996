"""Live cohorts as the service sees them (the `CohortStore` interface): joins, departures,
uploads and decisions kept, over a `CohortData` that only stores (state/: jobs by id).

What a join admits and what an upload must be are decision/admit.py's and
decision/upload_checks.py's rules; this module applies them to the data and keeps the
counts the limits need. Not thread-safe: one event loop owns it."""

from __future__ import annotations

from collections.abc import Callable

from cohortgate.coordinator.contract.digests import combine_uploaded, files_field
from cohortgate.coordinator.contract.errors import (
    FailedPrecondition,
    NotFound,
)
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.contract.manifest import HeldManifest, ManifestLike
from cohortgate.coordinator.decision import admit, asks
from cohortgate.coordinator.decision import upload_checks as checks
from cohortgate.coordinator.decision.asks import key_of, uploaded
from cohortgate.coordinator.decision.cohort import CohortState, Member, UploadKind, modules_key
from cohortgate.coordinator.decision.verdict import Decision, Outcome, Verdict
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.backends import open_cohort_data
from cohortgate.coordinator.state.base import (
    CohortData,
    CohortStore,
    InvalidUpload,
    Job,
    JoinIntent,
    JoinResult,
    LiveCohort,
)


class Cohorts(CohortStore):
    """Every job the coordinator holds, in `data` (this process's memory by default)."""

    def __init__(
        self,
        clock: Callable[[], float],
        last_round: Callable[[str], int] = lambda job_id: 0,
        limits: Limits | None = None,
        data: CohortData | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.waiting_cohorts = 0
        self.waiting_ranks = 0
        self.manifest_bytes = 0  # upload bytes of the manifests held, across cohorts
        self.clock = clock
        # After a restart, a job's rounds continue from the history's last one.
        self.last_round = last_round
        self.data = data if data is not None else open_cohort_data()

    # -- joins -------------------------------------------------------------------------
    def join(self, intent: JoinIntent, asked: set[bytes] | None = None) -> JoinResult:
        """`intent` joins its job's open round (or a new one), or gets the decided round it
        took part in. `asked`: the signatures a manifest ask is already ensured for, by the
        earlier ranks of the same call (this join adds its own)."""
        now = self.clock()
        member = intent.member
        member.joined_at = member.last_seen = now
        admit.check_rank(member.rank, intent.world_size)
        job = self.data.get(intent.job_id)
        if job is not None:
            replay = self._replay(job, intent) or self._successor(job, intent, now)
            if replay is not None:
                return replay
        opened = job is None or job.current.settled
        admit.check_room(self.waiting_cohorts, self.waiting_ranks, self.limits, opened)
        job = self._round_for(job, intent, now)
        return self._seat(job, job.current, intent, now, asked, opened=opened)

    def join_next(self, first: JoinResult, intent: JoinIntent, asked: set[bytes]) -> JoinResult:
        """Another rank of the call whose first rank joined as `first`: what `join` does for
        it, without looking up again what every rank of the call shares (the job and its
        open round, the call's clock); a call whose round moved meanwhile (a departure
        decided it) joins the long way."""
        cohort, member = first.cohort, intent.member
        job = self.data.get(intent.job_id)
        if (
            job is None
            or job.current is not cohort
            or cohort.settled
            or intent.round not in (0, cohort.round)
        ):
            return self.join(intent, asked)
        now = first.member.joined_at
        member.joined_at = member.last_seen = now
        admit.check_rank(member.rank, intent.world_size)
        replay = self._replay(job, intent)  # (no successor: the current round is open)
        if replay is not None:
            return replay
        admit.check_room(self.waiting_cohorts, self.waiting_ranks, self.limits, False)
        return self._seat(job, cohort, intent, now, asked, opened=False)

    def _seat(
        self,
        job: Job,
        cohort: LiveCohort,
        intent: JoinIntent,
        now: float,
        asked: set[bytes] | None,
        *,
        opened: bool,
    ) -> JoinResult:
        """The join takes its rank in the open round `cohort` (or is another launch's
        intruder there)."""
        member, state = intent.member, cohort.state
        admit.check_world(job.job_id, state.round, state.world_size, intent.world_size)
        held = state.members.get(member.rank)
        if admit.seat(job.job_id, state.round, held, member) is admit.Seat.INTRUDER:
            state.intruders.append(member)
            return JoinResult(cohort, member, intruder=True)
        if held is None:
            self.waiting_ranks += 1
        if opened:
            self.waiting_cohorts += 1
        state.add(member, now)
        self._ask(cohort, member, now, asked)
        return JoinResult(cohort, member, opened=opened)

    @staticmethod
    def _ask(cohort: LiveCohort, member: Member, now: float, asked: set[bytes] | None) -> None:
        """The first rank of each signature is asked for its manifest at once. Within one
        call, once per signature: members are only added while a call joins, so the ask
        its first rank of a signature ensured still stands for the next."""
        if asked is not None:
            if member.signature in asked:
                return
            asked.add(member.signature)
        asks.ask(
            cohort.asks, cohort.state, UploadKind.MANIFEST, member.signature, prefer=member, now=now
        )

    def _round_for(self, job: Job | None, intent: JoinIntent, now: float) -> Job:
        """The job with the round this join takes part in: its open one, or a new one."""
        if job is None:
            first = self.last_round(intent.job_id) + 1
            cohort = self._new_cohort(intent, first, now)
            job = Job(intent.job_id, cohort, {first: cohort}, last_decided=first - 1)
            self.data.put(job)
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
        decision/admit.py: SUCCESSOR_WINDOW_S), or None: the join takes part in the open (or
        a new) round."""
        cohort, new = job.current, intent.member
        held = cohort.state.members.get(new.rank)
        decided_at = cohort.settled_at if cohort.verdict is not None else None
        if held is None or not admit.is_successor(held, new, decided_at, now):
            return None
        job.incarnations[new.incarnation] = cohort.round  # its own re-joins replay too
        return JoinResult(cohort, held, replayed=True, successor=True)

    def _check_round(self, job: Job, asked: int, open_round: int) -> None:
        def outcome_of(round_: int) -> str | None:
            kept = job.rounds.get(round_)
            verdict = kept.verdict if kept is not None else None
            return verdict.outcome.value if verdict is not None else None

        admit.check_round(job.job_id, asked, open_round, job.last_decided, outcome_of)

    def _new_cohort(self, intent: JoinIntent, round_: int, now: float) -> LiveCohort:
        return LiveCohort(CohortState(intent.job_id, round_, intent.world_size, first_join_at=now))

    def _forget_old_rounds(self, job: Job) -> None:
        rounds = [(r, job.rounds[r].abandoned_at is not None) for r in sorted(job.rounds)]
        old = admit.rounds_to_forget(rounds)
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
        return asks.hand_over(cohort.asks, cohort.state, member)

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
        job = self.data.get(ref.job_id)
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
        asks.done(cohort.asks, kind, key)
        return InvalidUpload(message, cohort)

    def wants_upload(self, ref: UploadRef, kind: UploadKind, claimed: bytes, size: int) -> bool:
        what = "a manifest" if kind is UploadKind.MANIFEST else "digests"
        cohort, member = self._member(ref, what)
        if kind is UploadKind.MANIFEST:
            checks.check_claim(ref.rank, member, claimed)
        else:
            checks.check_digests_expected(ref.rank, member)
        checks.check_size(kind, ref.rank, member, size)
        wanted = not uploaded(cohort.state, kind, key_of(member, kind))
        if wanted and kind is UploadKind.MANIFEST:
            checks.check_manifest_budget(
                cohort.job_id,
                cohort.round,
                cohort.manifest_bytes,
                self.manifest_bytes,
                size,
                self.limits,
            )
        return wanted

    def upload(
        self, ref: UploadRef, manifest: ManifestLike, claimed: bytes, size: int = 0
    ) -> LiveCohort:
        cohort, member = self._member(ref, "a manifest")
        checks.check_claim(ref.rank, member, claimed)
        lie = checks.manifest_lie(ref.rank, member, manifest.signature(), claimed)
        if lie is not None:
            raise self._invalid(cohort, UploadKind.MANIFEST, claimed, lie)
        checks.check_entries(ref.rank, member, len(manifest), "manifest")
        if claimed not in cohort.state.manifests:
            held = manifest if isinstance(manifest, HeldManifest) else HeldManifest(manifest)
            cohort.state.manifests[claimed] = held
            cohort.manifest_bytes += size
            self.manifest_bytes += size
        asks.done(cohort.asks, UploadKind.MANIFEST, claimed)
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
                asks.ask(cohort.asks, cohort.state, UploadKind.DIGESTS, digest, now=now)
            for key in decision.awaiting_files:
                asks.ask(cohort.asks, cohort.state, UploadKind.FILES, key, now=now)
            return True
        assert verdict is not None, "a decided cohort comes with its verdict (judge)"
        cohort.verdict = verdict
        self._drop_uploads(cohort)
        self.waiting_cohorts -= 1
        self.waiting_ranks -= len(cohort.state.members)
        job = self.data.get(cohort.job_id)
        assert job is not None, "a cohort decided is of a job held"
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
        checks.check_digests_expected(ref.rank, member)
        checks.check_entries(ref.rank, member, count, "digests")
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
        lie = checks.digests_lie(ref.rank, member, combined)
        if lie is not None:
            raise self._invalid(cohort, UploadKind.DIGESTS, member.weights_digest, lie)
        cohort.state.tensor_digests.setdefault(member.weights_digest, tuple(digests))
        asks.done(cohort.asks, UploadKind.DIGESTS, member.weights_digest)
        return cohort

    def upload_files(self, ref: UploadRef, files: list[tuple[str, bytes]]) -> LiveCohort:
        cohort, member = self._member(ref, "code files")
        key = modules_key(member)
        if not key:
            raise FailedPrecondition(
                f"rank {ref.rank} joined without a modules field; there are no files to name"
            )
        asks.done(cohort.asks, UploadKind.FILES, key)
        lie = checks.files_lie(ref.rank, member, key, files_field(files).encode())
        if lie is not None:
            cohort.state.files.setdefault(key, ())  # unknown: the report says so
            raise InvalidUpload(lie, cohort)
        cohort.state.files.setdefault(key, tuple(files))
        return cohort

    def rotate_asks(self, cohort: LiveCohort, after_s: float) -> list[Member]:
        if cohort.settled:
            return []
        return asks.rotate(cohort.asks, cohort.state, self.clock(), after_s)

    def holds(self, job_id: str) -> bool:
        return self.data.get(job_id) is not None

    def find(self, job_id: str, round_: int = 0) -> LiveCohort | None:
        job = self.data.get(job_id)
        if job is None:
            return None
        return job.current if round_ == 0 else job.rounds.get(round_)

    def cohorts(self, job_id: str = "") -> list[LiveCohort]:
        one = self.data.get(job_id) if job_id else None
        selected = [one] if one is not None else [] if job_id else self.data.jobs()
        return [c for job in selected for _, c in sorted(job.rounds.items())]

    def evict(self, older_than_s: float) -> int:
        """Forget jobs decided longer ago than `older_than_s` (history keeps their verdicts),
        so a coordinator serving job after job holds a bounded number of them."""
        now = self.clock()
        stale = [
            job.job_id
            for job in self.data.jobs()
            if (settled := job.current.settled_at) is not None and now - settled > older_than_s
        ]
        for job_id in stale:
            self.data.drop(job_id)
        return len(stale)
