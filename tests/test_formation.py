"""The formation decision as a pure function, with an injected clock and no network."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from cohortgate.coordinator.decision.classes import signature_classes
from cohortgate.coordinator.decision.cohort import CohortState, Member, UploadKind
from cohortgate.coordinator.decision.formation import FormationOptions, decide
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import Cause, Outcome

SIG_A = b"a" * 32
SIG_B = b"b" * 32
SIG_C = b"c" * 32
OPTS = FormationOptions(join_deadline_s=60.0, manifest_timeout_s=10.0)


def member(rank: int, sig: bytes = SIG_A, host: str | None = None) -> Member:
    return Member(
        rank=rank,
        host=host or f"node{rank // 8}",
        pid=1000 + rank,
        incarnation=f"inc{rank}",
        signature=sig,
        manifest_entries=3,
    )


def cohort(world: int, sigs: dict[int, bytes] | None = None, t0: float = 100.0) -> CohortState:
    state = CohortState("job", 1, world, first_join_at=t0)
    for r, sig in (sigs or {}).items():
        state.add(member(r, sig), t0)
    return state


def manifest(width: int) -> Manifest:
    return Manifest.of([Entry(Kind.PARAMETER, "w", "float32", (width, 4), True)])


def test_waiting_until_every_rank_joined() -> None:
    state = cohort(4, {0: SIG_A, 1: SIG_A, 3: SIG_A})
    d = decide(state, 110.0, OPTS)
    assert d.outcome is Outcome.WAITING
    assert d.reason == "[3/4 ranks joined]"


def test_formed_when_complete_with_one_verified_signature() -> None:
    state = cohort(4, dict.fromkeys(range(4), SIG_A))
    waiting = decide(state, 101.0, OPTS)
    assert waiting.outcome is Outcome.WAITING
    assert waiting.awaiting_manifests == (SIG_A,)
    state.manifests[SIG_A] = manifest(4)
    d = decide(state, 101.0, OPTS)
    assert d.outcome is Outcome.FORMED
    assert d.reason == "[4/4 ranks joined, 1 signature]"


def test_formed_unverified_when_the_manifest_never_comes() -> None:
    state = cohort(2, dict.fromkeys(range(2), SIG_A))
    d = decide(state, 100.0 + OPTS.manifest_timeout_s, OPTS)
    assert d.outcome is Outcome.FORMED
    assert d.reason == "[2/2 ranks joined, 1 signature, manifest not verified]"


def test_an_invalid_manifest_refuses_once_every_rank_is_there() -> None:
    state = cohort(2, {0: SIG_A})
    state.invalid_uploads[(UploadKind.MANIFEST, SIG_A)] = "rank 0 lied"
    assert decide(state, 100.0, OPTS).outcome is Outcome.WAITING
    state.add(member(1), 100.0)
    d = decide(state, 100.0, OPTS)
    assert d.outcome is Outcome.REFUSED
    assert d.cause is Cause.MANIFEST_INVALID


def test_an_invalid_digest_upload_is_named_as_digests_not_as_a_manifest() -> None:
    state = cohort(2, {0: SIG_A, 1: SIG_A})
    state.invalid_uploads[(UploadKind.DIGESTS, b"d" * 32)] = "rank 1's digests lied"
    d = decide(state, 100.0, OPTS)
    assert d.cause is Cause.MANIFEST_INVALID
    assert d.reason == (
        "[1 uploaded per-tensor digest list(s) did not combine to the weights digest their "
        "rank joined with]"
    )


def test_invalid_uploads_are_refused_with_every_reason_in_one_report() -> None:
    state = cohort(2, {0: SIG_A, 1: SIG_A})
    state.invalid_uploads[(UploadKind.MANIFEST, SIG_A)] = "rank 0's manifest lied"
    state.invalid_uploads[(UploadKind.DIGESTS, b"d" * 32)] = "rank 1's digests lied"
    d, refusal = judge(state, 100.0, OPTS)
    assert (d.outcome, d.cause) == (Outcome.REFUSED, Cause.MANIFEST_INVALID)
    assert refusal is not None
    assert refusal.headline == "rank 0's manifest lied"  # the first reason
    assert refusal.report == (
        "cohortgate refused to form job 'job' round 1: a rank's uploaded digests and manifest "
        "did not match what it joined with.\n"
        "  rank 0's manifest lied\n"
        "  rank 1's digests lied\n"
        "What to do: run the same cohortgate version on every rank and the coordinator; a rank "
        "that changes its model after signing must sign again."
    )


def test_deadline_refuses_naming_missing_and_present_ranks() -> None:
    state = cohort(16, {r: SIG_A for r in range(16) if r not in (3, 7, 12, 13)})
    assert decide(state, 159.9, OPTS).outcome is Outcome.WAITING
    d = decide(state, 160.0, OPTS)
    assert d.outcome is Outcome.REFUSED
    assert d.cause is Cause.DEADLINE
    assert d.missing_ranks == (3, 7, 12, 13)
    assert ranges.compress(d.present_ranks) == "0-2,4-6,8-11,14-15"
    assert "missing ranks 3,7,12-13" in d.reason
    _, refusal = judge(state, 160.0, OPTS)
    assert refusal is not None
    assert (
        refusal.headline == "ranks 3,7,12-13 never joined (join deadline passed with 12/16 ranks)"
    )
    assert refusal.report == (
        "cohortgate refused to form job 'job' round 1: the join deadline (60s from the first "
        "join) passed with 12/16 ranks joined.\n"
        "missing ranks: 3,7,12-13\n"
        "present ranks: 0-2,4-6,8-11,14-15 on node0, node1\n"
        "What to do: find out why the missing ranks never reached cohortgate.join() (their "
        "logs, their nodes), or raise the deadline with --join-deadline."
    )


def test_a_round_every_rank_left_is_refused_at_its_deadline_with_none_present() -> None:
    d, refusal = judge(cohort(2, {}), 160.0, OPTS)
    assert (d.outcome, d.cause) == (Outcome.REFUSED, Cause.DEADLINE)
    assert refusal is not None
    assert "passed with 0/2 ranks joined.\nmissing ranks: 0-1\npresent ranks: none\nWhat" in (
        refusal.report
    )


def test_mismatch_waits_for_manifests_then_refuses() -> None:
    state = cohort(4, {0: SIG_A, 1: SIG_A, 2: SIG_B, 3: SIG_A})
    d = decide(state, 101.0, OPTS)
    assert d.outcome is Outcome.WAITING
    assert set(d.awaiting_manifests) == {SIG_A, SIG_B}
    state.manifests[SIG_A] = manifest(4)
    state.manifests[SIG_B] = manifest(8)
    d = decide(state, 101.0, OPTS)
    assert d.outcome is Outcome.REFUSED
    assert d.cause is Cause.SIGNATURE_MISMATCH
    assert d.reason == "[4/4 ranks joined, 2 different signatures]"


def test_mismatch_refuses_without_manifests_after_the_timeout() -> None:
    state = cohort(2, {0: SIG_A, 1: SIG_B})
    assert decide(state, 109.9, OPTS).outcome is Outcome.WAITING
    assert decide(state, 110.0, OPTS).outcome is Outcome.REFUSED


def test_reference_is_the_largest_class_ties_to_the_lowest_rank() -> None:
    state = cohort(
        8, {0: SIG_B, 1: SIG_A, 2: SIG_A, 3: SIG_C, 4: SIG_A, 5: SIG_B, 6: SIG_C, 7: SIG_C}
    )
    classes = signature_classes(state)
    assert [c.signature for c in classes] == [SIG_A, SIG_B, SIG_C]
    assert classes[0].reference and classes[0].ranks == (1, 2, 4)
    tie = cohort(4, {0: SIG_B, 1: SIG_A, 2: SIG_A, 3: SIG_B})
    assert signature_classes(tie)[0].signature == SIG_B  # holds rank 0


def test_classes_list_ranks_as_ranges_and_hosts() -> None:
    sigs = dict.fromkeys(range(16), SIG_A)
    sigs.update({6: SIG_B, 8: SIG_B})
    (ref, other) = signature_classes(cohort(16, sigs))
    assert ref.ranks_text == "0-5,7,9-15"
    assert other.ranks_text == "6,8"
    assert other.hosts == ("node0", "node1")


def test_a_rank_that_leaves_is_no_longer_counted() -> None:
    state = cohort(2, {0: SIG_A})
    m1 = member(1)
    state.add(m1, 100.0)
    assert state.complete
    state.remove(m1, 101.0)
    assert not state.complete
    assert decide(state, 101.0, OPTS).reason.startswith("[1/2 ranks joined")
    assert state.departures[0].rank == 1
    assert SIG_A in state.classes and state.classes[SIG_A] == {0}


@pytest.mark.parametrize(
    ("ranks", "text"),
    [([], ""), ([0], "0"), ([0, 1, 2, 3, 5, 7, 8], "0-3,5,7-8"), ([9, 1, 0, 1], "0-1,9")],
)
def test_ranges_round_trip(ranks: list[int], text: str) -> None:
    assert ranges.compress(ranks) == text
    assert ranges.expand(text) == sorted(set(ranks))


def test_capped_ranges_count_the_rest() -> None:
    text = ranges.compress_capped(range(0, 100, 2), max_runs=3)
    assert text == "0,2,4 and 47 more runs"


@given(
    st.sets(st.integers(min_value=0, max_value=199), max_size=200),
    st.integers(min_value=1, max_value=200),
    st.integers(min_value=1, max_value=30),
)
def test_missing_text_from_the_present_ranks_matches_the_brute_force(
    present: set[int], world: int, cap: int
) -> None:
    present = {r for r in present if r < world}
    expected = ranges.compress_capped(ranges.missing(present, world), cap)
    assert ranges.missing_text(present, world, cap) == expected


def test_a_snapshot_decides_alike_and_no_later_change_reaches_it() -> None:
    """What a worker thread decides on (CohortState.snapshot) while the loop changes the
    cohort: every container of the state is its own copy (a shared one changes under the
    worker, or fails its iteration)."""
    state = cohort(4, {0: SIG_A, 1: SIG_B, 2: SIG_A})
    state.manifests[SIG_A] = manifest(4)
    snap = state.snapshot()
    assert decide(snap, 101.0, OPTS) == decide(state, 101.0, OPTS)
    containers = [
        f.name
        for f in dataclasses.fields(state)
        if isinstance(getattr(state, f.name), dict | list | set)
    ]
    assert len(containers) == 9  # a new container field: copy it in snapshot(), then count it
    before = {name: copy.deepcopy(getattr(snap, name)) for name in containers}
    for name in containers:
        mine, theirs = getattr(state, name), getattr(snap, name)
        assert mine is not theirs, name
        if isinstance(mine, dict):
            mine[b"new" if name != "launches" else "new"] = None
        else:
            mine.append(None)
    state.classes[SIG_A].add(3)  # the index's sets are copied too
    assert {name: getattr(snap, name) for name in containers} == before


def test_the_cohorts_indexes_follow_members_that_come_go_and_are_replaced() -> None:
    """The launch counts (a second launch's join is a conflict only while the first still
    has members), the signature index, the version callers cache against, and departures."""
    from cohortgate.coordinator.decision.cohort import Departure

    state = CohortState("job", 1, 2, first_join_at=0.0)
    versions = [state.version]
    a0, a1 = (member(r, SIG_A) for r in range(2))
    a0.launch = a1.launch = "A"
    for m in (a0, a1):
        state.add(m, 1.0)
        versions.append(state.version)
    assert state.launches == {"A": 2} and state.classes == {SIG_A: {0, 1}}
    state.add(dataclasses.replace(a0, incarnation="again"), 2.0)  # replaced, same launch
    versions.append(state.version)
    assert state.launches == {"A": 2}
    state.remove(state.members[0], 3.0)
    versions.append(state.version)
    assert state.launches == {"A": 1} and state.classes == {SIG_A: {1}}
    state.remove(a1, 4.0)
    versions.append(state.version)
    assert state.launches == {} and state.classes == {}
    b0 = member(0, SIG_B)
    b0.launch = "B"
    state.add(b0, 5.0)
    versions.append(state.version)
    assert state.launches == {"B": 1}
    assert versions == sorted(set(versions))  # every change a new version
    assert state.departures == [
        Departure(0, a0.host, "again", 3.0),
        Departure(1, a1.host, a1.incarnation, 4.0),
    ]


def test_the_culprits_headline_counts_further_classes_and_names_no_side_in_a_tie() -> None:
    from cohortgate.coordinator.decision.words import culprits_headline

    three = cohort(6, {0: SIG_A, 1: SIG_A, 2: SIG_A, 3: SIG_B, 4: SIG_C, 5: SIG_A})
    assert culprits_headline(decide(three, 100.0, OPTS)) == (
        "rank 3 on node0 built a different model than ranks 0-2,5 (and 1 more class)"
    )
    tie = cohort(4, {0: SIG_A, 1: SIG_A, 2: SIG_B, 3: SIG_B})
    assert culprits_headline(decide(tie, 100.0, OPTS)) == (
        "no majority: ranks 0-1 on node0 and ranks 2-3 on node0 built different models; "
        "compare them to find which one is wrong"
    )


def test_a_job_policy_takes_the_job_id_up_to_its_last_colon_and_needs_one() -> None:
    from cohortgate.coordinator.decision.checks import Policies

    policies = Policies.parse(per_job=["org:job-1:model=warn"])
    assert policies.for_job("org:job-1")["model"] == "warn"
    assert policies.for_job("org")["model"] == "strict"
    for bad in (":weights=off", "weights=off"):
        with pytest.raises(ValueError, match="expected JOB:CHECK=LEVEL"):
            Policies.parse(per_job=[bad])


def test_the_words_reports_are_made_of() -> None:
    from cohortgate.coordinator.decision.words import all_ranks, hosts

    names = tuple(f"h{i}" for i in range(10))
    assert hosts(names[:8]) == "h0, h1, h2, h3, h4, h5, h6, h7"  # HOST_CAP: all named
    assert hosts(names[:9]) == "h0, h1, h2, h3, h4, h5, h6, h7 and 1 more"
    assert hosts(names) == "h0, h1, h2, h3, h4, h5, h6, h7 and 2 more"
    assert [all_ranks(n) for n in (1, 2, 3)] == ["the one rank", "both ranks", "all 3 ranks"]


def test_a_jobs_own_stall_bound_is_its_own_only() -> None:
    opts = FormationOptions(stall_after_s=300.0, job_stall_after=(("a", 5.0), ("b", None)))
    assert [opts.stall_after_for(j) for j in ("a", "b", "c")] == [5.0, None, 300.0]
