"""What a state backend must do, in two parts, each run against every backend.

- `VerdictStore` (the part a replicated backend, such as etcd for active/standby
  coordinators, implements): a verdict is stored before it is sent, replayed to a rank
  that re-joins with its incarnation, and rounds keep counting after a restart; audit
  findings are kept per job, oldest first, and outlive a restart.
- `CohortStore` (live cohorts, held in memory by the leading coordinator): joins, leaves,
  re-joins, intruders of another launch, uploads and asks, and keeping a decision.

A new backend adds one entry to VERDICT_BACKENDS or COHORT_BACKENDS (a factory over the
test's own backing: a file, a key prefix) and must pass everything here unchanged.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cohortgate.coordinator.contract.errors import (
    AlreadyHeld,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from cohortgate.coordinator.decision.cohort import Member, UploadKind
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import AuditFinding, Cause, Outcome, Verdict
from cohortgate.coordinator.etcd.client import EtcdSettings, EtcdThread
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.base import (
    CohortStore,
    InvalidUpload,
    JoinIntent,
    LiveCohort,
    VerdictRow,
    VerdictStore,
)
from cohortgate.coordinator.state.etcd_history import EtcdHistory
from cohortgate.coordinator.state.history import History
from cohortgate.coordinator.state.memory import MemoryStore
from cohortgate.coordinator.state.memory_history import Kept, MemoryHistory
from tests.etcd import EtcdServer
from tests.etcd import prefix as etcd_prefix
from tests.helpers import decide_in, manifest_of

pytestmark = pytest.mark.timeout(60)

M, WIDE = manifest_of(4), manifest_of(8)

# -- backends ------------------------------------------------------------------------------
# A verdict backend: given the test's directory, a function that opens the store on the same
# backing each time it is called (a second call: the store after a restart).
VerdictOpener = Callable[[], VerdictStore]


def _etcd_opener(tmp: Path, request: pytest.FixtureRequest) -> VerdictOpener:
    """An EtcdHistory on the session's etcd, under a prefix of the test's own, writing as
    the leader (a leader key this test created, its create revision the fencing token)."""
    server: EtcdServer = request.getfixturevalue("etcd")
    settings = EtcdSettings(server.endpoint, prefix=etcd_prefix())
    threads: list[EtcdThread] = []

    def close() -> None:
        for t in threads:
            t.close()

    request.addfinalizer(close)

    def opener() -> VerdictStore:
        thread = EtcdThread(settings)
        threads.append(thread)
        key = settings.key_prefix + b"leader"

        async def lead() -> int:
            await thread.client.put(key, b"{}")
            return int((await thread.client.range(key)).kvs[0].create_revision)

        token = thread.run(lead(), timeout=5)
        return EtcdHistory(thread, token=lambda: token)

    return opener


def _memory_opener(tmp: Path, request: pytest.FixtureRequest) -> VerdictOpener:
    """A MemoryHistory (--history off) over what the test's process keeps: a second one
    is the store reopened (the same process), as a file outlives a History."""
    kept = Kept()
    return lambda: MemoryHistory(kept=kept)


VERDICT_BACKENDS: dict[str, Callable[[Path, pytest.FixtureRequest], VerdictOpener]] = {
    "sqlite": lambda tmp, _: functools.partial(History, tmp / "history.sqlite"),
    "etcd": _etcd_opener,
    "memory": _memory_opener,
}
# A cohort backend: given a clock and the verdict store's last round, a store.
COHORT_BACKENDS: dict[str, Callable[[Callable[[], float], Callable[[str], int]], CohortStore]] = {
    "memory": MemoryStore,
}


@pytest.fixture(params=sorted(VERDICT_BACKENDS))
def open_verdicts(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[VerdictOpener]:
    opened: list[VerdictStore] = []
    open_one = VERDICT_BACKENDS[request.param](tmp_path, request)

    def opener() -> VerdictStore:
        store = open_one()
        opened.append(store)
        return store

    yield opener
    for store in opened:
        store.close()


class Clock:
    """Wall time, moved by hand (a verdict store may drop verdicts past its retention)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=sorted(COHORT_BACKENDS))
def store(request: pytest.FixtureRequest, clock: Clock) -> CohortStore:
    return COHORT_BACKENDS[request.param](clock, lambda job: 0)


def member(rank: int, manifest: object = M, launch: str = "node0:29500") -> Member:
    signature = manifest.signature()  # type: ignore[attr-defined]
    return Member(
        rank=rank,
        host=f"host{rank}",
        pid=100 + rank,
        incarnation=uuid.uuid4().hex,
        signature=signature,
        manifest_entries=len(manifest),  # type: ignore[arg-type]
        init_method="tcp://127.0.0.1:29999" if rank == 0 else "",
        launch=launch,
    )


def pair(store: CohortStore) -> tuple[LiveCohort, Member, Member]:
    """Ranks 0 and 1 of a 2-rank job "j", joined: its cohort and both members."""
    a, b = member(0), member(1)
    cohort = store.join(JoinIntent("j", 0, a, 2)).cohort
    store.join(JoinIntent("j", 0, b, 2))
    return cohort, a, b


def ref(cohort: LiveCohort, m: Member) -> UploadRef:
    return UploadRef(cohort.job_id, cohort.round, m.rank, m.incarnation)


def verdict_of(job: str, round_: int, outcome: Outcome = Outcome.FORMED) -> Verdict:
    return Verdict(
        outcome=outcome,
        job_id=job,
        round=round_,
        cohort_id=f"{job}/{round_}/{uuid.uuid4().hex[:8]}",
        world_size=2,
        reason="[2/2 ranks joined, 1 signature]",
        decided_at=time.time() - 10 + round_,
        cause=None if outcome is Outcome.FORMED else Cause.SIGNATURE_MISMATCH,
        report="" if outcome is Outcome.FORMED else "the report\nspans lines",
        headline="" if outcome is Outcome.FORMED else "rank 1 built a different model",
    )


def record(store: VerdictStore, verdict: Verdict, members: dict[int, str]) -> None:
    """Record and wait for `written`: what the service waits for before sending."""
    stored = threading.Event()
    store.record(VerdictRow.of(verdict, members), stored.set)
    assert stored.wait(10), f"the store never said it stored the verdict ({store.problem})"


# -- VerdictStore ----------------------------------------------------------------------------
def test_a_verdict_is_stored_before_it_is_sent_and_read_back_whole(
    open_verdicts: VerdictOpener,
) -> None:
    store = open_verdicts()
    sent = verdict_of("j", 1, Outcome.REFUSED)
    record(store, sent, {0: "a", 1: "b"})
    row = store.get("j", 1)
    assert row is not None and (row.outcome, row.cause) == ("refused", "signature_mismatch")
    assert row.report == sent.report and row.members == {0: "a", 1: "b"}
    assert store.verdict_of("j", "b") == sent, "replayed exactly as the ranks received it"
    assert store.problem == "" and store.spooled == 0


def test_a_rejoining_incarnation_gets_its_own_rounds_verdict_and_nobody_elses(
    open_verdicts: VerdictOpener,
) -> None:
    store = open_verdicts()
    first, second = verdict_of("j", 1, Outcome.REFUSED), verdict_of("j", 2)
    record(store, first, {0: "a1", 1: "b1"})
    record(store, second, {0: "a2", 1: "b2"})
    assert store.verdict_of("j", "a1") == first
    assert store.verdict_of("j", "b2") == second
    assert store.verdict_of("j", "stranger") is None
    assert store.verdict_of("other-job", "a1") is None
    for round_ in range(3, 8):  # only recent rounds replay
        record(store, verdict_of("j", round_), {0: f"a{round_}"})
    assert store.verdict_of("j", "a1", rounds=4) is None


def test_rounds_keep_counting_after_a_restart(open_verdicts: VerdictOpener) -> None:
    store = open_verdicts()
    assert store.last_round("j") == 0
    for round_ in (1, 2, 3):
        record(store, verdict_of("j", round_), {0: f"i{round_}"})
    record(store, verdict_of("k", 1), {0: "k1"})
    store.close()
    again = open_verdicts()  # the coordinator restarted
    assert again.last_round("j") == 3 and again.last_round("k") == 1
    assert again.verdict_of("j", "i3") is not None, "a rank re-joining after the restart"
    assert [r.round for r in again.recent(10, "j")] == [3, 2, 1], "newest first"
    assert again.get("j") is not None and again.get("j").round == 3  # type: ignore[union-attr]


def test_a_verdict_past_the_retention_is_gone_once_the_store_reopens(
    open_verdicts: VerdictOpener,
) -> None:
    """The bound on what a store keeps: verdicts decided longer ago than the retention (30
    days by default) are deleted when a writing store opens (SQLite's writer; etcd's leader,
    which also does it hourly), not kept forever."""
    store = open_verdicts()
    old = verdict_of("j", 1)
    old = Verdict(**{**old.__dict__, "decided_at": time.time() - 31 * 86400})
    record(store, old, {0: "a1"})
    record(store, verdict_of("j", 2), {0: "a2"})
    store.close()
    again = open_verdicts()
    assert [r.round for r in again.recent(10, "j")] == [2], "round 1 is past the retention"
    assert again.verdict_of("j", "a1") is None and again.verdict_of("j", "a2") is not None


def finding(job: str, step: int, at: float, kind: str = "diverged") -> AuditFinding:
    return AuditFinding(
        job, f"{job}/1/abcd", step, kind, "strict", f"h{step}", f"report {step}", at, step + 9
    )


def test_audit_findings_are_kept_per_job_oldest_first_and_outlive_a_restart(
    open_verdicts: VerdictOpener,
) -> None:
    """What a restarted coordinator (or a new leader) re-establishes a cohort's audits
    from: every field as recorded, one job's only, the newest `limit`; past the retention
    they are gone like verdicts."""
    store = open_verdicts()
    now = time.time()
    written = [finding("j", s, now - 10 + s) for s in range(5)]
    for f in [finding("j", 0, now - 31 * 86400), *reversed(written), finding("k", 7, now)]:
        store.record_audit(f)
    assert store.flush(5.0)
    store.close()
    again = open_verdicts()
    assert again.audits("j") == written, "every field, oldest first, none past the retention"
    assert again.audits("j", limit=2) == written[-2:]
    assert [f.step for f in again.audits("k")] == [7]
    assert again.audits("nobody") == []


def test_an_audit_finding_is_read_back_at_once_before_the_writer_files_it(
    open_verdicts: VerdictOpener,
) -> None:
    """The ranks are told of a divergence when it is found; `cohortgate explain` or
    ListAudits right after must show it, whether or not the writer has filed it yet (once:
    not twice when it is filed while being read)."""
    store = open_verdicts()
    now = time.time()
    written = [finding("j", s, now + s) for s in range(3)]
    for f in written:
        store.record_audit(f)
        assert store.audits("j")[-1] == f  # no flush in between
    assert store.audits("j") == written
    assert store.flush(5.0)
    assert store.audits("j") == written
    store.close()


def test_what_the_service_records_replays_through_a_new_coordinator(
    open_verdicts: VerdictOpener, clock: Clock
) -> None:
    """End to end over the two interfaces: a memory store decides, the verdict store keeps
    it; after a restart, the verdict store replays it and numbers the next round after it."""
    history = open_verdicts()
    live = MemoryStore(clock, history.last_round)
    a, b = member(0), member(1, WIDE)
    for m in (a, b):
        live.join(JoinIntent("j", 0, m, 2))
    cohort = live.find("j")
    assert cohort is not None
    for m, manifest in ((a, M), (b, WIDE)):
        live.upload(ref(cohort, m), manifest, m.signature)
    decide_in(live, cohort, clock())
    verdict = cohort.verdict
    assert verdict is not None and verdict.outcome is Outcome.REFUSED
    record(history, verdict, {m.rank: m.incarnation for m in (a, b)})
    history.close()
    restarted = open_verdicts()
    replayed = restarted.verdict_of("j", b.incarnation)
    assert replayed is not None and replayed.report == verdict.report
    assert replayed.diffs == verdict.diffs and replayed.classes == verdict.classes
    fresh = MemoryStore(clock, restarted.last_round)
    assert fresh.join(JoinIntent("j", 0, member(0), 2)).cohort.round == 2


# -- CohortStore -----------------------------------------------------------------------------
def test_joins_fill_one_open_round_and_say_what_is_wrong(store: CohortStore) -> None:
    a, b = member(0), member(1)
    first = store.join(JoinIntent("j", 0, a, 2))
    assert first.opened and first.cohort.round == 1
    assert (store.waiting_cohorts, store.waiting_ranks) == (1, 1)
    second = store.join(JoinIntent("j", 0, b, 2))
    assert second.cohort is first.cohort and not second.opened
    assert sorted(first.cohort.state.members) == [0, 1] and first.cohort.state.complete
    assert store.find("j") is first.cohort, "the live cohort: later changes show through it"
    assert store.holds("j") and not store.holds("k")
    with pytest.raises(InvalidArgument, match="outside"):
        store.join(JoinIntent("j", 0, member(2), 2))
    with pytest.raises(FailedPrecondition, match="world size 3 disagrees"):
        store.join(JoinIntent("j", 0, member(1), 3))
    with pytest.raises(AlreadyHeld, match="Two processes claim the same RANK"):
        store.join(JoinIntent("j", 0, member(1), 2))
    with pytest.raises(FailedPrecondition, match="round 7 of job 'j' does not exist yet"):
        store.join(JoinIntent("j", 7, member(1), 2))
    assert store.waiting_ranks == 2, "a refused join leaves no trace"


def test_another_launchs_rank_is_an_intruder_not_a_member(store: CohortStore, clock: Clock) -> None:
    store.join(JoinIntent("j", 0, member(0), 2))
    result = store.join(JoinIntent("j", 0, member(0, launch="node9:1234"), 2))
    assert result.intruder and result.cohort.state.intruders == [result.member]
    assert result.cohort.state.members[0].launch == "node0:29500"
    decide_in(store, result.cohort, clock())
    verdict = result.cohort.verdict
    assert verdict is not None and verdict.cause is Cause.LAUNCH


def test_a_rank_that_leaves_frees_its_rank_and_an_empty_round_is_abandoned(
    store: CohortStore, clock: Clock
) -> None:
    cohort, a, b = pair(store)
    assert not store.abandon(cohort), "ranks are still there"
    store.leave(cohort, b)
    assert sorted(cohort.state.members) == [0] and store.waiting_ranks == 1
    restarted = member(1)
    store.join(JoinIntent("j", 0, restarted, 2))
    assert cohort.state.members[1] is not b and cohort.state.holds(restarted)
    assert not cohort.state.holds(b), "the process that left is no member"
    store.leave(cohort, a)
    store.leave(cohort, restarted)
    assert store.abandon(cohort) and cohort.settled
    assert (store.waiting_cohorts, store.waiting_ranks) == (0, 0)
    clock.now += 1
    again = store.join(JoinIntent("j", 1, member(0), 4))  # any world size: a fresh round
    assert again.opened and again.cohort.round == 2


def test_a_decision_is_kept_and_replayed_to_a_rejoining_incarnation(
    store: CohortStore, clock: Clock
) -> None:
    cohort, a, b = pair(store)
    store.upload(ref(cohort, a), M, M.signature())
    decision = decide_in(store, cohort, clock())
    assert decision is not None and decision.outcome is Outcome.FORMED
    assert cohort.verdict is not None and cohort.settled
    assert (store.waiting_cohorts, store.waiting_ranks) == (0, 0)
    assert not cohort.state.manifests, "a decided cohort's uploads are freed"
    replay = store.join(JoinIntent("j", 0, b, 2))
    assert replay.replayed and replay.cohort is cohort
    late, verdict = judge(cohort.state, clock(), FormationOptions())
    assert not store.apply(cohort, late, verdict, clock()), "settled: nothing kept twice"
    restart = member(0)
    restart.restart_count = 1  # torchrun restarted every worker: a new round
    following = store.join(JoinIntent("j", 0, restart, 2))
    assert following.opened and following.cohort.round == 2
    with pytest.raises(FailedPrecondition, match="round 1 of job 'j' is over"):
        store.join(JoinIntent("j", 1, member(1), 2))


def test_uploads_are_checked_against_what_their_rank_joined_with(
    store: CohortStore, clock: Clock
) -> None:
    a, b = member(0), member(1, WIDE)
    cohort = store.join(JoinIntent("j", 0, a, 2)).cohort
    store.join(JoinIntent("j", 0, b, 2))
    stranger = UploadRef("j", 1, 0, "not-a-member")
    with pytest.raises(FailedPrecondition, match="join before uploading"):
        store.wants_upload(stranger, UploadKind.MANIFEST, M.signature(), 10)
    with pytest.raises(NotFound):
        store.wants_upload(UploadRef("nope", 1, 0, "x"), UploadKind.MANIFEST, b"", 10)
    assert store.wants_upload(ref(cohort, a), UploadKind.MANIFEST, M.signature(), 100)
    store.upload(ref(cohort, a), M, M.signature())
    assert M.signature() in cohort.state.manifests
    assert not store.wants_upload(ref(cohort, a), UploadKind.MANIFEST, M.signature(), 100)
    with pytest.raises(InvalidUpload, match="hashes to"):
        store.upload(ref(cohort, b), M, WIDE.signature())  # a manifest that is not its own
    assert cohort.state.invalid_uploads, "the cohort is refused, every rank hears why"
    decide_in(store, cohort, clock())
    assert cohort.verdict is not None and cohort.verdict.cause is Cause.MANIFEST_INVALID


def test_the_first_rank_of_each_signature_is_asked_and_the_ask_moves_when_it_leaves(
    store: CohortStore, clock: Clock
) -> None:
    a, b, c = member(0), member(1), member(2, WIDE)
    cohort = store.join(JoinIntent("j", 0, a, 3)).cohort
    store.join(JoinIntent("j", 0, b, 3))
    store.join(JoinIntent("j", 0, c, 3))
    asked = {m.rank: [x.kind for x in cohort.asks.of(m)] for m in (a, b, c)}
    assert asked == {0: [UploadKind.MANIFEST], 1: [], 2: [UploadKind.MANIFEST]}
    assert store.leave(cohort, a) == [b], "the ask goes to another rank of its signature"
    assert [x.kind for x in cohort.asks.of(b)] == [UploadKind.MANIFEST]
    clock.now += 10
    assert store.rotate_asks(cohort, 5.0) == [], "nobody else holds the wide signature"


def test_settled_jobs_are_evicted_and_listed_until_then(store: CohortStore, clock: Clock) -> None:
    a = member(0)
    cohort = store.join(JoinIntent("done", 0, a, 1)).cohort
    store.upload(ref(cohort, a), M, M.signature())
    decide_in(store, cohort, clock())
    store.join(JoinIntent("open", 0, member(0), 2))
    assert [c.job_id for c in store.cohorts()] == ["done", "open"]
    assert [c.job_id for c in store.cohorts("open")] == ["open"]
    clock.now += 100
    assert store.evict(50) == 1 and not store.holds("done") and store.holds("open")
