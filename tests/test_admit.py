"""The admission and upload rules as pure functions (decision/admit.py,
decision/upload_checks.py), each at its bound and one past it, with the words the rank
reads. The store contract suite runs them through a store; here they stand alone."""

from __future__ import annotations

import dataclasses

import pytest

from cohortgate.coordinator.contract.digests import DIGEST_BYTES
from cohortgate.coordinator.contract.errors import (
    AlreadyHeld,
    FailedPrecondition,
    InvalidArgument,
    LimitExceeded,
)
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.decision import admit
from cohortgate.coordinator.decision import upload_checks as checks
from cohortgate.coordinator.decision.cohort import Member, UploadKind
from tests.helpers import manifest_of, member_of

pytestmark = pytest.mark.timeout(30)

M = manifest_of()


def held(**overrides: object) -> Member:
    return member_of(1, M, **{"launch": "node0:29500", "host": "node0", **overrides})


def test_a_rank_must_be_inside_the_world_and_the_waiting_room_bounded() -> None:
    admit.check_rank(3, 4)
    with pytest.raises(InvalidArgument, match=r"^rank 4 is outside \[0, 4\) for world size 4$"):
        admit.check_rank(4, 4)
    limits = Limits(max_cohorts=2, max_waiting_ranks=10)
    admit.check_room(1, 9, limits, opening=True)
    admit.check_room(2, 9, limits, opening=False)  # joins an open cohort: no new one
    with pytest.raises(LimitExceeded, match=r"^2 cohorts are waiting, the limit max_cohorts=2;"):
        admit.check_room(2, 0, limits, opening=True)
    with pytest.raises(LimitExceeded, match=r"^10 ranks are waiting, the limit max_waiting_ranks"):
        admit.check_room(0, 10, limits, opening=False)


@pytest.mark.parametrize(
    ("change", "decided_ago", "successor"),
    [
        ({}, 0.0, True),
        ({}, admit.SUCCESSOR_WINDOW_S, True),
        ({}, admit.SUCCESSOR_WINDOW_S + 0.01, False),
        ({"elastic": True}, 1.0, False),  # torchrun's workers belong in the next round
        ({"launch": "node0:29501"}, 1.0, False),
        ({"restart_count": 1}, 1.0, False),
        ({"signature": b"\x01" * 32}, 1.0, False),
        ({"weights_digest": b"\x02" * 32}, 1.0, False),
        ({"agreed": {"config": (("n_layer", "13"),)}}, 1.0, False),
    ],
)
def test_a_new_process_succeeds_its_rank_only_of_the_same_launch_model_and_window(
    change: dict[str, object], decided_ago: float, successor: bool
) -> None:
    old = held()
    new = dataclasses.replace(old, incarnation="new", pid=999, **change)  # type: ignore[arg-type]
    assert admit.is_successor(old, new, 100.0 - decided_ago, 100.0) is successor


def test_without_a_launch_a_successor_is_on_the_same_host_and_only_of_a_decided_round() -> None:
    old = held(launch="")
    same_host = dataclasses.replace(old, incarnation="new")
    assert admit.is_successor(old, same_host, 99.0, 100.0)
    assert not admit.is_successor(old, dataclasses.replace(same_host, host="node1"), 99.0, 100.0)
    assert not admit.is_successor(old, same_host, None, 100.0), "not decided"
    assert not admit.is_successor(None, same_host, 99.0, 100.0), "nobody held the rank"


def test_a_rejoin_naming_a_round_joins_the_open_one_unless_a_round_since_was_decided() -> None:
    outcomes = {3: "refused"}
    for asked in (0, 5, 4):  # none named, the open one, one abandoned since round 3
        admit.check_round("j", asked, 5, 3, outcomes.get)
    with pytest.raises(FailedPrecondition) as over:
        admit.check_round("j", 2, 5, 3, outcomes.get)
    assert str(over.value) == (
        "round 2 of job 'j' is over (refused); the open round is 5. Join without a round to "
        "take part in it."
    )
    with pytest.raises(FailedPrecondition, match=r"^round 1 of job 'j' is over \(decided\)"):
        admit.check_round("j", 1, 5, 3, lambda round_: None)  # forgotten since
    with pytest.raises(FailedPrecondition) as ahead:
        admit.check_round("j", 6, 5, 3, outcomes.get)
    assert str(ahead.value) == "round 6 of job 'j' does not exist yet; the open round is 5"


def test_a_held_rank_is_the_same_process_an_intruder_or_a_second_claim() -> None:
    old = held()
    assert admit.seat("j", 1, None, old) is admit.Seat.FREE
    assert admit.seat("j", 1, old, dataclasses.replace(old)) is admit.Seat.SAME
    other_launch = dataclasses.replace(old, incarnation="x", launch="node9:1")
    assert admit.seat("j", 1, old, other_launch) is admit.Seat.INTRUDER
    for twin in (
        dataclasses.replace(old, incarnation="x"),
        dataclasses.replace(old, incarnation="x", launch=""),
    ):
        with pytest.raises(AlreadyHeld) as raised:
            admit.seat("j", 1, old, twin)
        said = str(raised.value)
        assert said.startswith("rank 1 of job 'j' round 1 is already held by incarnation ")
        assert said.endswith("Two processes claim the same RANK: check the launcher."), said
    with pytest.raises(FailedPrecondition, match=r"^world size 3 disagrees with job 'j' round 2"):
        admit.check_world("j", 2, 4, 3)
    admit.check_world("j", 2, 4, 4)


def test_the_newest_rounds_are_kept_and_abandoned_ones_never_push_out_a_verdict() -> None:
    n = admit.ROUNDS_KEPT
    decided = [(r, False) for r in range(1, n + 3)]
    assert admit.rounds_to_forget(decided) == [1, 2]
    flapping = [(1, False)] + [(r, True) for r in range(2, 3 * n)]
    forgotten = admit.rounds_to_forget(flapping)
    assert 1 not in forgotten and forgotten == list(range(2, 3 * n - n))
    assert admit.rounds_to_forget([]) == []


def test_an_upload_is_bounded_by_the_entries_its_rank_announced() -> None:
    member = held(manifest_entries=10, weights_digest=b"\x03" * 32)
    most = {
        UploadKind.MANIFEST: 10 * checks.MAX_ENTRY_WIRE_BYTES + checks.UPLOAD_SLACK_BYTES,
        UploadKind.DIGESTS: 10 * (DIGEST_BYTES + 8) + checks.UPLOAD_SLACK_BYTES,
    }
    for kind, bound in most.items():
        checks.check_size(kind, 1, member, bound)
        with pytest.raises(LimitExceeded) as raised:
            checks.check_size(kind, 1, member, bound + 1)
        what = "a manifest" if kind is UploadKind.MANIFEST else "digests"
        assert str(raised.value) == (
            f"the {what} upload of rank 1 is {bound + 1} bytes, more than its 10-entry "
            f"manifest can take ({bound} bytes at most)"
        )
    checks.check_entries(1, member, 10, "manifest")
    with pytest.raises(InvalidArgument, match=r"has 9 entries, but the join announced 10$"):
        checks.check_entries(1, member, 9, "manifest")
    with pytest.raises(InvalidArgument, match=r"^11 digests uploaded, but rank 1's manifest"):
        checks.check_entries(1, member, 11, "digests")


def test_the_manifests_held_are_bounded_per_cohort_and_in_all() -> None:
    limits = Limits(max_cohort_manifest_bytes=100, max_manifest_bytes=150)
    checks.check_manifest_budget("j", 1, 60, 100, 40, limits)  # exactly at both
    with pytest.raises(LimitExceeded, match=r"^job 'j' round 1 holds 61 bytes of manifests"):
        checks.check_manifest_budget("j", 1, 61, 61, 40, limits)
    with pytest.raises(LimitExceeded, match=r"^this coordinator holds 111 bytes"):
        checks.check_manifest_budget("j", 1, 0, 111, 40, limits)


def test_an_upload_that_is_not_what_its_rank_joined_with_is_named() -> None:
    member = held(weights_digest=b"\x03" * 32)
    checks.check_claim(1, member, member.signature)
    with pytest.raises(InvalidArgument, match=r"^upload claims signature 010101010101, but rank 1"):
        checks.check_claim(1, member, b"\x01" * 32)
    assert checks.manifest_lie(1, member, member.signature, member.signature) is None
    lie = checks.manifest_lie(1, member, b"\x01" * 32, member.signature)
    assert lie is not None and lie.startswith("the manifest uploaded by rank 1 (host node0)")
    assert checks.digests_lie(1, member, member.weights_digest) is None
    assert "do not combine to the weights digest" in (checks.digests_lie(1, member, b"") or "")
    assert checks.files_lie(1, member, b"m:abc", b"m:abc") is None
    joined = b"sha256:" + b"ab" * 32  # a modules field as agents send it: 71 characters
    assert checks.files_lie(1, member, joined, b"m:abd") == (
        "the code files uploaded by rank 1 (host node0) do not combine to the modules field "
        f"it joined with ({joined.decode()[:64]}): a file changed on disk since the join, or "
        "agent and coordinator versions differ"
    )
    checks.check_digests_expected(1, member)
    with pytest.raises(FailedPrecondition, match=r"joined without a weights digest"):
        checks.check_digests_expected(1, held())
