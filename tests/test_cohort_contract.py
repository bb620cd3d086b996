"""What a backend of live jobs must do, run against every one: `CohortData` stores jobs by id
(storage alone), and the service's rules over it (`Cohorts`, the `CohortStore` the service
talks to: joins, leaves, re-joins, intruders of another launch, uploads and asks, keeping a
decision) hold over every data backend.

A new backend adds one entry to COHORT_DATA_BACKENDS (a factory of an empty one) and must
pass everything here unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cohortgate.coordinator.contract.digests import combine_uploaded, files_field
from cohortgate.coordinator.contract.errors import (
    AlreadyHeld,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from cohortgate.coordinator.decision import asks
from cohortgate.coordinator.decision import upload_checks as checks
from cohortgate.coordinator.decision.cohort import CohortState, UploadKind
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import Cause, Outcome
from cohortgate.coordinator.service.cohorts import Cohorts
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.base import (
    CohortData,
    CohortStore,
    InvalidUpload,
    Job,
    JoinIntent,
    LiveCohort,
)
from cohortgate.coordinator.state.memory import MemoryCohorts
from tests.contract import WIDE, Clock, M, member, pair, ref
from tests.helpers import decide_in

pytestmark = pytest.mark.timeout(60)

# A backend of live jobs: a factory of an empty one.
COHORT_DATA_BACKENDS: dict[str, Callable[[], CohortData]] = {"memory": MemoryCohorts}


@pytest.fixture(params=sorted(COHORT_DATA_BACKENDS))
def data(request: pytest.FixtureRequest) -> CohortData:
    return COHORT_DATA_BACKENDS[request.param]()


@pytest.fixture
def store(data: CohortData, clock: Clock) -> CohortStore:
    """The service's rules over the data backend."""
    return Cohorts(clock, lambda job: 0, data=data)


# -- CohortData: storage alone ---------------------------------------------------------------
def test_live_jobs_are_kept_by_id_returned_live_listed_in_order_and_dropped(
    data: CohortData,
) -> None:
    def job(job_id: str) -> Job:
        cohort = LiveCohort(CohortState(job_id, 1, 2, first_join_at=1.0))
        return Job(job_id, cohort, {1: cohort})

    assert data.get("a") is None and data.jobs() == []
    a, b = job("a"), job("b")
    data.put(a)
    data.put(b)
    assert data.get("a") is a, "the live object: later changes show through it"
    a.last_decided = 1
    assert data.get("a") is not None and data.get("a").last_decided == 1  # type: ignore[union-attr]
    data.put(a)  # the same job again: kept once
    assert [j.job_id for j in data.jobs()] == ["a", "b"]
    data.drop("a")
    data.drop("nobody")
    assert data.get("a") is None and [j.job_id for j in data.jobs()] == ["b"]


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


def test_the_rest_of_a_call_joins_as_each_rank_would_alone(store: CohortStore) -> None:
    """`join_next`: a call's later ranks skip what the call shares, not a rule: each is
    admitted, refused, seated as an intruder or held again exactly as `join` would."""
    a, b, c = member(0), member(1), member(2, WIDE)
    asked: set[bytes] = set()
    head = store.join(JoinIntent("j", 0, a, 4), asked)
    for m in (b, c):
        result = store.join_next(head, JoinIntent("j", 0, m, 4), asked)
        assert result.cohort is head.cohort and not (result.opened or result.intruder)
    cohort = head.cohort
    assert sorted(cohort.state.members) == [0, 1, 2] and store.waiting_ranks == 3
    kinds = {m.rank: [x.kind for x in asks.of(cohort.asks, m)] for m in (a, b, c)}
    assert kinds == {0: [UploadKind.MANIFEST], 1: [], 2: [UploadKind.MANIFEST]}
    assert asked == {M.signature(), WIDE.signature()}, "each signature asked once a call"
    again = store.join_next(head, JoinIntent("j", 0, b, 4), asked)
    assert again.member is b and store.waiting_ranks == 3, "the same process again"
    with pytest.raises(InvalidArgument, match="outside"):
        store.join_next(head, JoinIntent("j", 0, member(4), 4), asked)
    with pytest.raises(FailedPrecondition, match="world size 5 disagrees"):
        store.join_next(head, JoinIntent("j", 0, member(3), 5), asked)
    with pytest.raises(AlreadyHeld, match="Two processes claim the same RANK"):
        store.join_next(head, JoinIntent("j", 0, member(1), 4), asked)
    with pytest.raises(FailedPrecondition, match="round 7 of job 'j' does not exist yet"):
        store.join_next(head, JoinIntent("j", 7, member(3), 4), asked)
    other = store.join_next(head, JoinIntent("j", 0, member(1, launch="node9:1"), 4), asked)
    assert other.intruder and cohort.state.intruders == [other.member]
    assert store.waiting_ranks == 3 and sorted(cohort.state.members) == [0, 1, 2]


def test_the_rest_of_a_call_gets_its_decided_round_back_or_goes_the_long_way(
    store: CohortStore, clock: Clock
) -> None:
    cohort, a, b = pair(store)
    store.upload(ref(cohort, a), M, M.signature())
    decide_in(store, cohort, clock())
    restart = member(0)
    restart.restart_count = 1
    head = store.join(JoinIntent("j", 0, restart, 2), set())
    assert head.opened and head.cohort.round == 2
    replay = store.join_next(head, JoinIntent("j", 0, b, 2), set())
    assert replay.replayed and replay.cohort is cohort, "b took part in the decided round 1"
    store.leave(head.cohort, restart)
    assert store.abandon(head.cohort)  # the call's round is over: the next rank opens one
    late = member(1)
    late.restart_count = 1
    moved = store.join_next(head, JoinIntent("j", 0, late, 2), set())
    assert moved.opened and moved.cohort.round == 3


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
    assert (UploadKind.MANIFEST, WIDE.signature()) not in cohort.asks.open, "nobody asked again"
    decide_in(store, cohort, clock())
    assert cohort.verdict is not None and cohort.verdict.cause is Cause.MANIFEST_INVALID


def test_code_files_are_kept_for_their_modules_field_once_and_a_lie_keeps_none(
    store: CohortStore,
) -> None:
    """A rank's local code files, asked for when ranks' code differs: kept under the
    `modules` field its rank joined with (the first list for a field stays), its ask done;
    a list that does not combine to that field is refused and keeps nothing to name."""
    files = {r: [(f"m{r}.py", bytes([r]) * 32), ("train.py", b"\x09" * 32)] for r in range(3)}
    ranks = [member(r) for r in range(3)]
    for r, m in enumerate(ranks[:2]):
        m.agreed = {"code": (("modules", files_field(files[r])),)}
    cohort = store.join(JoinIntent("j", 0, ranks[0], 3)).cohort
    for m in ranks[1:]:
        store.join(JoinIntent("j", 0, m, 3))
    key = files_field(files[0]).encode()
    asks.ask(cohort.asks, cohort.state, UploadKind.FILES, key, prefer=ranks[0])
    assert store.upload_files(ref(cohort, ranks[0]), files[0]) is cohort
    assert cohort.state.files == {key: tuple(files[0])}
    assert (UploadKind.FILES, key) not in cohort.asks.open, "the ask is answered"
    store.upload_files(ref(cohort, ranks[0]), files[0])
    assert cohort.state.files == {key: tuple(files[0])}, "kept once"
    lying = files_field(files[1]).encode()
    with pytest.raises(InvalidUpload) as raised:
        store.upload_files(ref(cohort, ranks[1]), files[0])
    assert str(raised.value) == checks.files_lie(1, ranks[1], lying, key)
    assert str(raised.value).startswith("the code files uploaded by rank 1 (host host1) do not")
    assert raised.value.cohort is cohort and cohort.state.files[lying] == ()
    with pytest.raises(FailedPrecondition) as without:
        store.upload_files(ref(cohort, ranks[2]), files[2])
    assert str(without.value) == (
        "rank 2 joined without a modules field; there are no files to name"
    )
    with pytest.raises(FailedPrecondition) as stranger:
        store.upload_files(UploadRef("j", 1, 0, "not-a-member"), files[0])
    assert str(stranger.value) == (
        "rank 0 incarnation not-a-member is not a member of job 'j' round 1: join before "
        "uploading code files"
    )


def test_digests_are_refused_until_their_rank_can_send_them_each_cause_in_full(
    store: CohortStore,
) -> None:
    a, b = member(0), member(1)
    b.weights_digest = b"\x07" * 32
    cohort = store.join(JoinIntent("j", 0, a, 2)).cohort
    store.join(JoinIntent("j", 0, b, 2))
    n = len(M)
    for who, count, error, says in (
        (
            UploadRef("j", 1, 1, "nobody"),
            n,
            FailedPrecondition,
            "rank 1 incarnation nobody is not a member of job 'j' round 1: join before "
            "uploading digests",
        ),
        (
            ref(cohort, a),
            n,
            FailedPrecondition,
            "rank 0 joined without a weights digest; there is nothing to explain",
        ),
        (
            ref(cohort, b),
            n + 1,
            InvalidArgument,
            f"{n + 1} digests uploaded, but rank 1's manifest has {n} entries: send one per "
            "entry, in manifest order",
        ),
        (
            ref(cohort, b),
            n,
            FailedPrecondition,
            "the manifest of rank 1's signature is not uploaded yet; digests are named by its "
            "entries",
        ),
    ):
        with pytest.raises(error) as raised:
            store.upload_digests(who, [b"\x00" * 32] * count)
        assert str(raised.value) == says


def test_digests_that_combine_to_their_weights_digest_are_kept_and_others_refused(
    store: CohortStore,
) -> None:
    digests = [bytes([i]) * 32 for i in range(len(M))]
    a, b = member(0), member(1)
    a.weights_digest = combine_uploaded((e.name for e in M.entries), digests)
    b.weights_digest = b"\x07" * 32  # digests that combine to something else
    cohort = store.join(JoinIntent("j", 0, a, 2)).cohort
    store.join(JoinIntent("j", 0, b, 2))
    store.upload(ref(cohort, a), M, M.signature())
    assert store.upload_digests(ref(cohort, a), digests) is cohort
    assert cohort.state.tensor_digests == {a.weights_digest: tuple(digests)}
    with pytest.raises(InvalidUpload) as raised:
        store.upload_digests(ref(cohort, b), digests)
    assert str(raised.value) == checks.digests_lie(1, b, a.weights_digest)
    assert (UploadKind.DIGESTS, b.weights_digest) in cohort.state.invalid_uploads
    assert b.weights_digest not in cohort.state.tensor_digests


def test_the_first_rank_of_each_signature_is_asked_and_the_ask_moves_when_it_leaves(
    store: CohortStore, clock: Clock
) -> None:
    a, b, c = member(0), member(1), member(2, WIDE)
    cohort = store.join(JoinIntent("j", 0, a, 3)).cohort
    store.join(JoinIntent("j", 0, b, 3))
    store.join(JoinIntent("j", 0, c, 3))
    asked = {m.rank: [x.kind for x in asks.of(cohort.asks, m)] for m in (a, b, c)}
    assert asked == {0: [UploadKind.MANIFEST], 1: [], 2: [UploadKind.MANIFEST]}
    assert store.leave(cohort, a) == [b], "the ask goes to another rank of its signature"
    assert [x.kind for x in asks.of(cohort.asks, b)] == [UploadKind.MANIFEST]
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
