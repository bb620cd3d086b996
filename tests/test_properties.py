"""Properties of the pure parts, over generated inputs: the verdict does not depend on the
order the ranks joined in; one differing byte anywhere that must agree (a signature, a
manifest entry, a config key or value, a declared fact, a layout coordinate) is refused and
the odd rank named; rank ranges survive their round trip."""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.fingerprint import Fields
from cohortgate.coordinator.contract.layout import Layout, layout
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from cohortgate.coordinator.decision.checks import Policies
from cohortgate.coordinator.decision.cohort import CohortState, Member
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import Level, Outcome, Verdict
from tests.helpers import examples

STRICT = FormationOptions(
    join_deadline_s=60.0,
    policies=Policies({"config": Level.STRICT, "facts": Level.STRICT, "code": Level.STRICT}),
)
BASE = Manifest.of(
    [
        Entry(Kind.PARAMETER, "fc.weight", "float32", (4, 8), True),
        Entry(Kind.PARAMETER, "fc.bias", "float32", (4,), True),
        Entry(Kind.BUFFER, "norm.running_mean", "float32", (4,), False),
    ]
)
CONFIG: Fields = (("hidden_size", "64"), ("n_layer", "2"), ("rope_theta", "10000.0"))
FACTS: Fields = (("data", "mix-v3"), ("resume_step", "1200"))


def _member(
    rank: int, manifest: Manifest, agreed: Mapping[str, Fields], built: Layout | None = None
) -> Member:
    return Member(
        rank=rank,
        host=f"node{rank // 2}",
        pid=1000 + rank,
        incarnation=f"i{rank}",
        signature=manifest.signature(),
        manifest_entries=len(manifest),
        runtime={"device_type": "cpu"},
        layout=built,
        agreed=dict(agreed),
    )


def _state(members: list[Member], manifests: list[Manifest], world: int) -> CohortState:
    s = CohortState("prop", 1, world, first_join_at=0.0)
    for m in members:
        s.add(m, 0.0)
    for manifest in manifests:
        s.manifests[manifest.signature()] = manifest
    return s


def _verdict(s: CohortState) -> Verdict:
    decision, verdict = judge(s, 1.0, STRICT)
    assert decision.outcome is not Outcome.WAITING and verdict is not None, decision.reason
    return verdict


def _flip(text: str, at: int) -> str:
    """`text` with one character changed (a byte of its UTF-8, for the ASCII used here)."""
    i = at % len(text)
    return text[:i] + chr(ord(text[i]) ^ 1) + text[i + 1 :]


def _flip_fields(fields: Fields, which: int, at: int, key: bool) -> Fields:
    i = which % len(fields)
    name, value = fields[i]
    changed = (_flip(name, at), value) if key else (name, _flip(value, at))
    return tuple(sorted((*fields[:i], changed, *fields[i + 1 :])))


def _flip_manifest(which: int, at: int, part: str) -> Manifest:
    entries = list(BASE.entries)
    e = entries[which % len(entries)]
    if part == "name":
        entries[which % len(entries)] = Entry(
            e.kind, _flip(e.name, at), e.dtype, e.shape, e.requires_grad
        )
    elif part == "dtype":
        dtype = "float16" if e.dtype == "float32" else "float32"
        entries[which % len(entries)] = Entry(e.kind, e.name, dtype, e.shape, e.requires_grad)
    else:
        shape = tuple(d + 1 if i == at % len(e.shape) else d for i, d in enumerate(e.shape))
        entries[which % len(entries)] = Entry(e.kind, e.name, e.dtype, shape, e.requires_grad)
    return Manifest.of(entries)


# -- order -----------------------------------------------------------------------------
@settings(max_examples=examples(150), deadline=None)
@given(
    world=st.integers(min_value=2, max_value=8),
    odd=st.sets(st.integers(min_value=0, max_value=7), max_size=3),
    seed=st.randoms(use_true_random=False),
)
def test_any_order_of_joins_gives_the_same_verdict(world: int, odd: set[int], seed: object) -> None:
    """Same members, joined in two orders: the same outcome, cause, reason and report."""
    wide = _flip_manifest(0, 0, "shape")
    members = [
        _member(r, wide if r in odd else BASE, {"config": CONFIG, "facts": FACTS})
        for r in range(world)
    ]
    shuffled = list(members)
    seed.shuffle(shuffled)  # type: ignore[attr-defined]
    a = _verdict(_state(members, [BASE, wide], world))
    b = _verdict(_state(shuffled, [wide, BASE], world))
    assert (a.outcome, a.cause, a.reason, a.report) == (b.outcome, b.cause, b.reason, b.report)
    wide_ranks = len({r for r in odd if r < world})
    expected = Outcome.REFUSED if 0 < wide_ranks < world else Outcome.FORMED
    assert a.outcome is expected


# -- one byte ----------------------------------------------------------------------------
@settings(max_examples=examples(200), deadline=None)
@given(
    world=st.integers(min_value=3, max_value=8),
    culprit=st.integers(min_value=0, max_value=7),
    what=st.sampled_from(
        [
            *("manifest name", "manifest dtype", "manifest shape"),
            *("config key", "config value", "facts key", "facts value"),
        ]
    ),
    which=st.integers(min_value=0, max_value=10),
    at=st.integers(min_value=0, max_value=40),
)
def test_one_differing_byte_that_must_agree_is_refused_naming_the_rank(
    world: int, culprit: int, what: str, which: int, at: int
) -> None:
    culprit %= world
    agreed: dict[str, Fields] = {"config": CONFIG, "facts": FACTS}
    manifest = BASE
    kind, _, part = what.partition(" ")
    if kind == "manifest":
        manifest = _flip_manifest(which, at, part)
    else:
        agreed = {**agreed, kind: _flip_fields(agreed[kind], which, at, key=part == "key")}
    members = [
        _member(r, manifest, agreed) if r == culprit else _member(r, BASE, {"config": CONFIG})
        for r in range(world)
    ]
    for m in members:  # every rank declares the same facts, but the culprit's may differ
        if m.rank != culprit:
            m.agreed = {"config": CONFIG, "facts": FACTS}
    verdict = _verdict(_state(members, [BASE, manifest], world))
    assert verdict.outcome is Outcome.REFUSED, (what, verdict.reason)
    # Named as itself: "on rank 3", "rank 3", or its class "[3]"; never as a plural.
    said = verdict.report
    assert f"rank {culprit}" in said or f"[{culprit}]" in said, said
    assert f"ranks {culprit}," not in said and not said.endswith(f"ranks {culprit}"), said


@settings(max_examples=examples(100), deadline=None)
@given(
    culprit=st.integers(min_value=0, max_value=3),
    field=st.sampled_from(["tp", "dp"]),
)
def test_a_layout_coordinate_claimed_twice_is_refused_naming_the_rank(
    culprit: int, field: str
) -> None:
    """tp=2 x dp=2: the culprit claims its neighbour's coordinate on one axis."""
    members = []
    for r in range(4):
        position = {"tp": r % 2, "dp": r // 2}
        if r == culprit:
            position[field] = 1 - position[field]
        decl = layout(r, tp=2, dp=2)
        decl.position.update(position)
        decl.replicated("fc.weight", (4, 8))
        decl.replicated("fc.bias", (4,))
        decl.replicated("norm.running_mean", (4,))
        members.append(_member(r, BASE, {}, decl.build()))
    verdict = _verdict(_state(members, [BASE], 4))
    assert verdict.outcome is Outcome.REFUSED, verdict.reason
    # Two ranks hold one position: which of them is wrong no one can say; both are named.
    held = re.search(r"is held by ranks (\S+):", verdict.report)
    assert held is not None and culprit in ranges.expand(held.group(1)), verdict.report


# -- rank ranges -------------------------------------------------------------------------
@settings(max_examples=examples(300), deadline=None)
@given(st.sets(st.integers(min_value=0, max_value=5000), max_size=300))
def test_rank_ranges_round_trip_and_are_canonical(ranks: set[int]) -> None:
    text = ranges.compress(ranks)
    assert ranges.expand(text) == sorted(ranks)
    runs = [run.partition("-") for run in text.split(",")] if text else []
    bounds = [(int(lo), int(hi) if sep else int(lo)) for lo, sep, hi in runs]
    for (_, end), (start, _) in itertools.pairwise(bounds):
        assert start > end + 1, text  # runs never touch: no two could have been one


@settings(max_examples=examples(200), deadline=None)
@given(
    st.sets(st.integers(min_value=0, max_value=500), max_size=200),
    st.integers(min_value=1, max_value=10),
)
def test_capped_ranges_list_the_first_runs_and_count_the_rest(ranks: set[int], cap: int) -> None:
    whole = ranges.compress(ranks).split(",") if ranks else []
    capped = ranges.compress_capped(ranks, cap)
    if len(whole) <= cap:
        assert capped == ",".join(whole)
    else:
        assert capped == ",".join(whole[:cap]) + f" and {len(whole) - cap} more runs"
