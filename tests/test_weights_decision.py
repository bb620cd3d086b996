"""The weights check, the pure part (decision/checks/weights.py): which refusal a difference
in weights is (values, buffers computed from the config, digests unsent), what its finding
names (the ranks against their reference, their hosts, the tensors that differ), and the
wait for the per-tensor digests that name them. The same refusals from real torch ranks are
in test_weights.py."""

from __future__ import annotations

import hashlib

import pytest

from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from cohortgate.coordinator.decision.checks import Policies
from cohortgate.coordinator.decision.cohort import CohortState
from cohortgate.coordinator.decision.formation import FormationOptions, decide, uploads_due
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import Cause, Level, Outcome
from tests.helpers import member_of

PARAMS = 12
MODEL = Manifest.of(
    [Entry(Kind.PARAMETER, f"p{i}", "float32", (4,), True) for i in range(PARAMS)]
    + [Entry(Kind.BUFFER, "rope.freqs", "float32", (4,), False)]
)
OPTS = FormationOptions(join_deadline_s=60, policies=Policies.parse(["weights=strict"]))
REF, ODD = b"r" * 32, b"o" * 32


def h(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def tensors(changed: set[str]) -> tuple[bytes, ...]:
    """Per-tensor digests, in manifest order, with the tensors `changed` changed."""
    return tuple(h(e.name, e.name in changed) for e in MODEL.entries)


def cohort(
    world: int,
    odd: set[int],
    known: dict[bytes, tuple[bytes, ...]],
    unsent: frozenset[int] = frozenset(),
) -> CohortState:
    state = CohortState("w", 1, world, first_join_at=0.0)
    for r in range(world):
        digest = b"" if r in unsent else ODD if r in odd else REF
        state.add(member_of(r, MODEL, weights_digest=digest), 0.0)
    state.manifests[MODEL.signature()] = MODEL
    state.tensor_digests.update(known)
    return state


def test_replicas_differing_only_in_buffers_are_told_their_configs_differ() -> None:
    known = {REF: tensors(set()), ODD: tensors({"rope.freqs"})}
    d, refusal = judge(cohort(8, {5}, known), 1.0, OPTS)
    assert (d.outcome, d.cause, d.weights) == (Outcome.REFUSED, Cause.WEIGHTS, "buffers")
    assert d.reason == "[8/8 ranks joined, models match, buffers differ (model config)]"
    assert [(f.check, f.level, f.text, f.ranks) for f in d.findings] == [
        (
            "weights",
            Level.STRICT,
            "1 rank(s) [5] on host1 hold other weights than ranks [0-4,6-7]: 1 of 13 tensors "
            "differ, first 'rope.freqs'",
            (5,),
        )
    ]
    assert refusal is not None and refusal.report == (
        "cohortgate refused to form job 'w' round 1: all 8 ranks joined with matching models, "
        "but buffers computed from the model config differ (the weights themselves agree): the "
        "ranks' model configs differ, not their seeds.\n"
        "strict weights: 1 rank(s) [5] on host1 hold other weights than ranks [0-4,6-7]: 1 of "
        "13 tensors differ, first 'rope.freqs'\n"
        "What to do: compare the model config on the ranks named (for example rope_theta, "
        "rope_scaling, max_position_embeddings): buffers such as rotary frequencies are "
        "computed from it. Load one config everywhere."
    )


def test_a_parameter_beside_the_buffers_makes_it_a_difference_of_values() -> None:
    known = {REF: tensors(set()), ODD: tensors({"p3", "rope.freqs"})}
    d = decide(cohort(8, {5}, known), 1.0, OPTS)
    assert (d.outcome, d.weights) == (Outcome.REFUSED, "values")
    assert d.findings[0].text.endswith("2 of 13 tensors differ, first 'p3', 'rope.freqs'")


def test_ten_differing_tensors_are_named_and_the_rest_counted() -> None:
    every = {f"p{i}" for i in range(PARAMS)}
    known = {REF: tensors(set()), ODD: tensors(every)}
    d = decide(cohort(8, {5}, known), 1.0, OPTS)
    shown = ", ".join(f"'p{i}'" for i in range(10))
    assert d.findings[0].text.endswith(f"12 of 13 tensors differ, first {shown} and 2 more")
    known = {REF: tensors(set()), ODD: tensors(every - {"p10", "p11"})}
    d = decide(cohort(8, {5}, known), 1.0, OPTS)
    assert d.findings[0].text.endswith(f"10 of 13 tensors differ, first {shown}")


def test_the_odd_ranks_hosts_are_named_four_then_elided() -> None:
    """Ranks 0-19 (hosts 0-4) against the larger reference 20-43."""
    d = decide(cohort(44, set(range(20)), {}), 100.0, OPTS)
    assert [(f.text, f.ranks) for f in d.findings] == [
        (
            "20 rank(s) [0-19] on host0, host1, host2, host3 ... hold other weights than "
            "ranks [20-43]",
            tuple(range(20)),
        )
    ]
    d = decide(cohort(44, set(range(16)), {}), 100.0, OPTS)  # four hosts: all named
    assert d.findings[0].text.startswith("16 rank(s) [0-15] on host0, host1, host2, host3 hold")


@pytest.mark.parametrize("came", [ODD, REF])
def test_the_check_waits_for_the_digest_lists_it_lacks_then_refuses_without_names(
    came: bytes,
) -> None:
    state = cohort(8, {5}, {came: tensors({"p1"} if came == ODD else set())})
    lacking = REF if came == ODD else ODD
    due = uploads_due(state, 1.0, OPTS)
    waiting = decide(state, due - 0.1, OPTS)
    assert waiting.outcome is Outcome.WAITING and waiting.awaiting_digests == (lacking,)
    assert waiting.reason == "[8/8 ranks joined, weights differ, waiting for 1 digest list(s)]"
    d = decide(state, due, OPTS)  # no longer: refused with what it knows
    assert (d.outcome, d.weights) == (Outcome.REFUSED, "values")
    assert [(f.check, f.text, f.ranks) for f in d.findings] == [
        ("weights", "1 rank(s) [5] on host1 hold other weights than ranks [0-4,6-7]", (5,))
    ]


def test_two_ranks_that_differ_are_each_a_class_of_one() -> None:
    known = {REF: tensors(set()), ODD: tensors({"p0"})}
    d = decide(cohort(2, {1}, known), 1.0, OPTS)
    assert [(f.text, f.ranks) for f in d.findings] == [
        (
            "1 rank(s) [1] on host0 hold other weights than ranks [0]: 1 of 13 tensors differ, "
            "first 'p0'",
            (1,),
        )
    ]


def test_classes_past_the_reference_are_told_by_their_lowest_rank() -> None:
    """Three weights: the largest (ranks 0-4) is the reference; rank 5's class is told before
    ranks 6-7's whatever their digests' order."""
    state = cohort(8, {5}, {})
    state.members[6].weights_digest = b"a" * 32  # sorts before ODD, held by higher ranks
    state.members[7].weights_digest = b"a" * 32
    d = decide(state, 100.0, OPTS)
    assert [f.ranks for f in d.findings] == [(5,), (6, 7)]


def test_sharded_weights_without_a_layout_are_told_to_declare_one() -> None:
    state = cohort(4, {3}, {REF: tensors(set()), ODD: tensors({"p0"})})
    for m in state.members.values():
        m.sharded_without_layout = True
    d, refusal = judge(state, 1.0, OPTS)
    assert (d.outcome, d.weights) == (Outcome.REFUSED, "sharded")
    assert refusal is not None and "their parameters are sharded DTensors" in refusal.report


def test_ranks_that_sent_no_digest_are_named_under_strict() -> None:
    d, refusal = judge(cohort(8, set(), {}, unsent=frozenset({2, 3})), 1.0, OPTS)
    assert (d.outcome, d.weights) == (Outcome.REFUSED, "unsent")
    assert d.reason == "[8/8 ranks joined, models match, weight digests missing]"
    assert [(f.check, f.text, f.ranks) for f in d.findings] == [
        (
            "weights",
            "2 rank(s) 2-3 sent no weight digest; call cohortgate.join(model, "
            "verify_values=True) on every rank",
            (2, 3),
        )
    ]
    assert refusal is not None and "sent no weight digest, which the weights check" in (
        refusal.report
    )


def test_a_rank_without_a_digest_does_not_hide_the_ranks_after_it() -> None:
    known = {REF: tensors(set()), ODD: tensors({"p0"})}
    d = decide(cohort(8, {5}, known, unsent=frozenset({2})), 1.0, OPTS)
    assert [f.ranks for f in d.findings] == [(2,), (5,)]
