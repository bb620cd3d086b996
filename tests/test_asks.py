"""One ask: a rank of a class is asked for an upload, handed over when it leaves, and an
upload that does not match is named by its kind. Cohorts-level, with no network."""

from __future__ import annotations

import pytest

from cohortgate.coordinator.contract.digests import DIGEST_BYTES, combine
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from cohortgate.coordinator.decision import asks
from cohortgate.coordinator.decision.checks import Policies
from cohortgate.coordinator.decision.cohort import Member, UploadKind
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.verdict import Cause, Outcome
from cohortgate.coordinator.service.cohorts import Cohorts
from cohortgate.coordinator.state.asks import UploadRef
from cohortgate.coordinator.state.base import InvalidUpload, JoinIntent
from tests.helpers import decide_in

MANIFEST = Manifest.of([Entry(Kind.PARAMETER, "w", "float32", (4, 4), True)])
PER_TENSOR = {d: [bytes([d]) * DIGEST_BYTES] for d in (1, 2)}
WEIGHTS = {d: combine(zip(["w"], PER_TENSOR[d], strict=True)) for d in (1, 2)}


OPTIONS = FormationOptions(policies=Policies.parse(["weights=strict"]))


def _registry() -> Cohorts:
    return Cohorts(clock=lambda: 100.0)


def _join(registry: Cohorts, rank: int, digest: int) -> Member:
    member = Member(
        rank=rank,
        host=f"node{rank}",
        pid=rank,
        incarnation=f"i{rank}",
        signature=MANIFEST.signature(),
        manifest_entries=1,
        weights_digest=WEIGHTS[digest],
    )
    registry.join(JoinIntent("job", 0, member, 3))
    return member


def _ref(m: Member) -> UploadRef:
    return UploadRef("job", 1, m.rank, m.incarnation)


def test_a_digest_ask_is_handed_over_when_its_rank_leaves() -> None:
    registry = _registry()
    members = [_join(registry, 0, 1), _join(registry, 1, 1), _join(registry, 2, 2)]
    cohort = registry.find("job")
    assert cohort is not None
    assert [a.kind for a in asks.of(cohort.asks, members[0])] == [UploadKind.MANIFEST]
    registry.upload(_ref(members[0]), MANIFEST, MANIFEST.signature())
    decision = decide_in(registry, cohort, 100.0, OPTIONS)
    assert decision is not None and decision.outcome is Outcome.WAITING
    assert [a.kind for a in asks.of(cohort.asks, members[0])] == [UploadKind.DIGESTS]
    assert [a.kind for a in asks.of(cohort.asks, members[2])] == [UploadKind.DIGESTS]
    assert asks.of(cohort.asks, members[1]) == []
    successors = registry.leave(cohort, members[0])
    assert successors == [members[1]]
    assert [(a.kind, a.key) for a in asks.of(cohort.asks, members[1])] == [
        (UploadKind.DIGESTS, WEIGHTS[1])
    ]


def test_digests_that_do_not_combine_refuse_as_digests_not_as_a_manifest() -> None:
    registry = _registry()
    members = [_join(registry, 0, 1), _join(registry, 1, 1), _join(registry, 2, 2)]
    cohort = registry.find("job")
    assert cohort is not None
    registry.upload(_ref(members[0]), MANIFEST, MANIFEST.signature())
    decide_in(registry, cohort, 100.0, OPTIONS)
    with pytest.raises(InvalidUpload, match="do not combine to the weights digest"):
        registry.upload_digests(_ref(members[2]), PER_TENSOR[1])  # rank 2 holds digest 2
    decide_in(registry, cohort, 100.0, OPTIONS)
    verdict = cohort.verdict
    assert verdict is not None and verdict.cause is Cause.MANIFEST_INVALID
    assert "digest list(s) did not combine" in verdict.reason
    assert "manifest" not in verdict.reason
    assert "uploaded digests did not match what it joined with" in verdict.report
    assert verdict.headline.startswith("the per-tensor digests uploaded by rank 2")


def test_a_rejoin_naming_an_abandoned_round_is_over_once_the_next_round_is_decided() -> None:
    from cohortgate.coordinator.contract.errors import FailedPrecondition

    store = Cohorts(clock=lambda: 100.0)

    def member(rank: int, incarnation: str) -> Member:
        return Member(rank, "h", 1, incarnation, MANIFEST.signature(), 1)

    old = member(0, "old")
    store.join(JoinIntent("j", 0, old, 1))
    first = store.find("j")
    assert first is not None
    store.leave(first, old)
    assert store.abandon(first)  # round 1: every rank left
    again = member(0, "second")
    store.join(JoinIntent("j", 1, again, 1))  # names round 1: takes part in round 2
    second = store.find("j")
    assert second is not None and second.round == 2
    store.upload(UploadRef("j", 2, 0, "second"), MANIFEST, MANIFEST.signature())
    assert decide_in(store, second, 100.0) is not None and second.verdict is not None  # formed
    with pytest.raises(FailedPrecondition, match="round 1 of job 'j' is over"):
        # another host's process (on "h" it would be rank 0's successor: see _successor)
        store.join(JoinIntent("j", 1, Member(0, "h2", 1, "third", MANIFEST.signature(), 1), 1))
