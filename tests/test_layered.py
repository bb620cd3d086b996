"""Layered identity, placement, replica groups, coverage and runtime policies: the pure
decision with an injected clock, no network."""

from __future__ import annotations

from typing import Any

import pytest

from cohortgate.coordinator.contract.layout import (
    MEGATRON_ORDER,
    Layout,
    LayoutBuilder,
    config_fingerprint,
    layout,
    position_from_rank,
)
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from cohortgate.coordinator.decision.checks import Policies
from cohortgate.coordinator.decision.cohort import CohortState, Member
from cohortgate.coordinator.decision.formation import FormationOptions, decide
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import Cause, Level, Outcome


def manifest(rows: int) -> Manifest:
    return Manifest.of([Entry(Kind.PARAMETER, "fc1.weight", "float32", (rows, 16), True)])


def mesh_layout(rank: int, rows: int = 32, claimed: int | None = None, **overrides: int) -> Layout:
    sizes: dict[str, Any] = {"tp": 2, "pp": 2, "dp": 2, **overrides}
    decl: LayoutBuilder = layout(rank if claimed is None else claimed, **sizes)
    tp, pp = decl.position["tp"], decl.position["pp"]
    decl.shard(f"layers.{pp}.fc1.weight", (64, 16), (tp * 32, 0), (rows, 16))
    decl.replicated(f"layers.{pp}.fc2.bias", (16,))
    return decl.build()


def cohort(
    layouts: dict[int, Layout],
    sigs: dict[int, Manifest] | None = None,
    runtime: dict[int, dict[str, str]] | None = None,
) -> CohortState:
    state = CohortState("mesh", 1, len(layouts), first_join_at=0.0)
    for r, lay in layouts.items():
        m = (sigs or {}).get(r, manifest(lay.pieces[0].length[0] if lay.pieces else 32))
        state.add(
            Member(
                rank=r,
                host=f"node{r // 4}",
                pid=r,
                incarnation=f"i{r}",
                signature=m.signature(),
                manifest_entries=len(m),
                runtime=(runtime or {}).get(r, {"device_type": "cuda", "nccl_version": "2.21.5"}),
                layout=lay,
            ),
            0.0,
        )
        state.manifests[m.signature()] = m
    return state


OPTS = FormationOptions(join_deadline_s=60)


def test_megatron_order_positions() -> None:
    sizes = {"tp": 2, "pp": 2, "dp": 2}
    assert position_from_rank(0, sizes) == {"tp": 0, "cp": 0, "ep": 0, "dp": 0, "pp": 0}
    assert position_from_rank(3, sizes)["tp"] == 1 and position_from_rank(3, sizes)["dp"] == 1
    assert position_from_rank(5, sizes, MEGATRON_ORDER)["pp"] == 1
    assert position_from_rank(5, sizes, "pp-dp-tp") == {"pp": 1, "dp": 0, "tp": 1, "cp": 0, "ep": 0}
    with pytest.raises(ValueError, match="must name each"):
        position_from_rank(0, sizes, "tp-tp")


def test_config_fingerprint_ignores_metadata() -> None:
    a = config_fingerprint({"hidden": 64, "_name_or_path": "/ckpt/a", "transformers_version": "4"})
    assert a == config_fingerprint({"hidden": 64, "_name_or_path": "/other"})
    assert a != config_fingerprint({"hidden": 65})


def test_a_correct_mesh_forms_with_different_signatures_per_position() -> None:
    d = decide(cohort({r: mesh_layout(r) for r in range(8)}), 1.0, OPTS)
    assert d.outcome is Outcome.FORMED, d.findings
    assert "across 4 replica groups" in d.reason


def test_wrong_width_is_refused_naming_tensor_range_and_ranks() -> None:
    layouts = {r: mesh_layout(r, rows=40 if r == 2 else 32) for r in range(8)}
    d = decide(cohort(layouts), 1.0, OPTS)
    assert d.outcome is Outcome.REFUSED and d.cause is Cause.LAYOUT
    assert [(f.check, f.level, f.text, f.ranks) for f in d.findings] == [
        (
            "coverage",
            Level.STRICT,
            "replica dp=1: 'layers.0.fc1.weight': overlap: [32:40, 0:16] is held twice: by "
            "[0:40, 0:16] on rank 2 and by [32:64, 0:16] on rank 3",
            (2, 3),
        ),
        ("model", Level.STRICT, "1 replica group holds differing signatures", (0, 2)),
    ]
    assert {c.group for c in d.classes} == {"tp=0 cp=0 ep=0 pp=0"}


def test_duplicate_position_is_refused_by_placement() -> None:
    layouts = {r: mesh_layout(r, claimed=4 if r == 5 else None) for r in range(8)}
    d = decide(cohort(layouts), 1.0, OPTS)
    assert d.outcome is Outcome.REFUSED
    texts = [f.text for f in d.findings if f.check == "layout"]
    assert "position tp=0 cp=0 ep=0 dp=0 pp=1 is held by ranks 4-5" in texts[0]


def test_a_broken_mesh_is_refused_for_its_layout_and_a_tolerated_one_for_its_model() -> None:
    """Under layout=strict a broken mesh is the refusal, and its replica groups (which a
    broken mesh makes up) are not compared; under layout=warn they are, and a rank that
    differs from its replica peer is refused for its model."""
    layouts = {r: mesh_layout(r, claimed=4 if r == 5 else None) for r in range(8)}
    held = (
        "position tp=0 cp=0 ep=0 dp=0 pp=1 is held by ranks 4-5: every position must be held "
        "exactly once"
    )
    d = decide(cohort(layouts, {3: manifest(33)}), 1.0, OPTS)
    assert (d.outcome, d.cause) == (Outcome.REFUSED, Cause.LAYOUT)
    assert [(f.check, f.level, f.text, f.ranks) for f in d.findings] == [
        ("layout", Level.STRICT, held, (4, 5))
    ]
    warn = FormationOptions(policies=Policies.parse(["layout=warn"]))
    d = decide(cohort(layouts, {3: manifest(33)}), 1.0, warn)
    assert (d.outcome, d.cause) == (Outcome.REFUSED, Cause.SIGNATURE_MISMATCH)
    assert [(f.check, f.level, f.text, f.ranks) for f in d.findings] == [
        ("layout", Level.WARN, held, (4, 5)),
        ("model", Level.STRICT, "1 replica group holds differing signatures", (1, 3)),
    ]


def test_global_fields_listed_by_value_and_ranks() -> None:
    layouts = {r: mesh_layout(r) for r in range(8)}
    for r in range(4, 8):
        layouts[r] = Layout(
            dict(layouts[r].sizes, tp=4), layouts[r].position, pieces=layouts[r].pieces
        )
    d = decide(cohort(layouts), 1.0, OPTS)
    assert d.outcome is Outcome.REFUSED
    assert "tp_size: 2 on ranks 0-3, 4 on ranks 4-7" in [f.text for f in d.findings]


def test_mesh_that_does_not_match_the_world_size() -> None:
    full = {r: mesh_layout(r) for r in range(8)}
    layouts = {
        r: Layout(dict(lay.sizes, dp=1), lay.position, pieces=lay.pieces) for r, lay in full.items()
    }
    d = decide(cohort(layouts), 1.0, OPTS)
    assert any("has 4 positions but the world size is 8" in f.text for f in d.findings)


def test_replicated_pieces_must_agree() -> None:
    layouts = {r: mesh_layout(r) for r in range(8)}
    bad = layouts[1]
    pieces = (bad.pieces[0], bad.pieces[1].__class__("layers.0.fc2.bias", (16,), (0,), (8,), True))
    layouts[1] = Layout(bad.sizes, bad.position, pieces=pieces)
    d = decide(cohort(layouts), 1.0, OPTS)
    assert [(f.check, f.level, f.text, f.ranks) for f in d.findings] == [
        (
            "coverage",
            Level.STRICT,
            "replica dp=0: 'layers.0.fc2.bias' replicated pieces disagree: [0:16] on rank 0, "
            "[0:8] on rank 1",
            (0, 1),
        )
    ]


def test_a_rank_without_a_layout_among_ranks_with_one() -> None:
    layouts = {r: mesh_layout(r) for r in range(8)}
    state = cohort(layouts)
    state.members[7].layout = None
    d = decide(state, 1.0, OPTS)
    assert d.outcome is Outcome.REFUSED
    assert "ranks 7 declared no layout" in d.findings[0].text


def test_runtime_policies_strict_warn_and_per_job() -> None:
    runtime = {
        r: {"device_type": "cuda", "nccl_version": "2.21.5", "torch_version": "2.13.0"}
        for r in range(8)
    }
    runtime[6] = dict(runtime[6], torch_version="2.13.1")
    d = decide(cohort({r: mesh_layout(r) for r in range(8)}, runtime=runtime), 1.0, OPTS)
    assert d.outcome is Outcome.FORMED
    assert d.warnings == ("runtime.torch: torch_version: 2.13.0 on ranks 0-5,7, 2.13.1 on rank 6",)
    runtime[6] = dict(runtime[6], nccl_version="2.18.1")
    d, refusal = judge(cohort({r: mesh_layout(r) for r in range(8)}, runtime=runtime), 1.0, OPTS)
    assert d.outcome is Outcome.REFUSED and d.cause is Cause.RUNTIME
    assert refusal is not None and refusal.headline == (  # the odd rank, not all eight
        "runtime.nccl: nccl_version: 2.21 on ranks 0-5,7, 2.18 on rank 6"
    )
    relaxed = FormationOptions(policies=Policies.parse(per_job=["mesh:runtime.nccl=warn"]))
    d = decide(cohort({r: mesh_layout(r) for r in range(8)}, runtime=runtime), 1.0, relaxed)
    assert d.outcome is Outcome.FORMED and len(d.warnings) == 2


def test_model_policy_warn_forms_and_off_ignores() -> None:
    layouts = {r: mesh_layout(r) for r in range(8)}
    sigs = {3: manifest(33)}  # rank 3 differs from rank 1, its replica peer
    warn = FormationOptions(policies=Policies.parse(["model=warn"]))
    d = decide(cohort(layouts, sigs), 1.0, warn)
    assert d.outcome is Outcome.FORMED
    assert d.warnings == ("model: replica groups hold differing signatures",)
    strict = decide(cohort(layouts, sigs), 1.0, OPTS)
    assert strict.outcome is Outcome.REFUSED and strict.cause is Cause.SIGNATURE_MISMATCH


def test_policy_parsing_names_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="CHECK=LEVEL"):
        Policies.parse(["coverage=maybe"])
    with pytest.raises(ValueError, match="JOB:CHECK=LEVEL"):
        Policies.parse(per_job=["coverage=off"])
    assert Policies.parse(["coverage=off"]).for_job("x")["coverage"] == "off"


def test_a_replica_missing_a_tensor_is_named() -> None:
    layouts = {r: mesh_layout(r) for r in range(8)}
    for r in (2, 3):  # dp=1, pp=0: drop the fc2 bias
        lay = layouts[r]
        layouts[r] = Layout(lay.sizes, lay.position, pieces=lay.pieces[:1])
    d = decide(cohort(layouts), 1.0, OPTS)
    assert d.outcome is Outcome.REFUSED
    (f,) = [f for f in d.findings if "declares no piece" in f.text]
    assert f.text == (
        "replica dp=1 declares no piece of 'layers.0.fc2.bias', which other replicas hold"
    )
    assert f.check == "coverage" and f.level.value == "strict"
    assert f.ranks == (2, 3)  # its ranks at pp=0, where the others hold it; not 6, 7 (pp=1)


def test_a_replica_missing_many_tensors_names_ten_and_counts_the_rest() -> None:
    def replica(rank: int, tensors: int) -> Layout:
        decl = layout(rank, dp=2)
        for t in range(tensors):
            decl.replicated(f"t{t:02}", (4,))
        return decl.build()

    layouts = {0: replica(0, 13), 1: replica(1, 1)}
    d = decide(cohort(layouts), 1.0, OPTS)
    assert d.outcome is Outcome.REFUSED
    (f,) = [f for f in d.findings if "declares no piece" in f.text]
    shown = ", ".join(f"'t{t:02}'" for t in range(1, 11))
    assert f.text == (
        f"replica dp=1 declares no piece of {shown} and 2 more, which other replicas hold"
    )
    assert f.ranks == (1,)
    layouts = {0: replica(0, 11), 1: replica(1, 1)}  # ten absent: all named, none counted
    (f,) = [f for f in decide(cohort(layouts), 1.0, OPTS).findings if "no piece" in f.text]
    assert f.text.endswith("'t10', which other replicas hold")


def test_weights_are_compared_within_each_replica_group_only() -> None:
    """Shards at different positions hold different weights by design; only ranks of one
    replica group (differing in dp alone) must agree."""
    import hashlib

    layouts = {r: mesh_layout(r) for r in range(8)}
    state = cohort(layouts)

    def digest(key: object) -> bytes:
        return hashlib.sha256(repr(key).encode()).digest()

    for r, m in state.members.items():
        m.weights_digest = digest(layouts[r].replica_key)
    strict = FormationOptions(policies=Policies.parse(["weights=strict"]))
    d = decide(state, 1.0, strict)
    assert d.outcome is Outcome.FORMED, d.reason

    peer = next(r for r in range(8) if r != 3 and layouts[r].replica_key == layouts[3].replica_key)
    state.members[3].weights_digest = digest("stale checkpoint")
    d = decide(state, 1.0, strict)
    assert d.outcome is Outcome.WAITING  # for one list per digest class of that group only
    assert set(d.awaiting_digests) == {
        state.members[peer].weights_digest,
        digest("stale checkpoint"),
    }
    state.tensor_digests[state.members[peer].weights_digest] = (digest("a"),)
    state.tensor_digests[digest("stale checkpoint")] = (digest("b"),)
    d = decide(state, 1.0, strict)
    assert d.outcome is Outcome.REFUSED and d.cause is Cause.WEIGHTS
    (finding,) = [f for f in d.findings if f.check == "weights"]
    assert finding.text == (
        "replica group tp=1 cp=0 ep=0 pp=0: 1 rank(s) [3] on node0 hold other weights than "
        "ranks [1]: 1 of 1 tensors differ, first 'fc1.weight'"
    )
    assert peer == 1


def test_every_registered_check_has_a_policy_and_a_help_line() -> None:
    from cohortgate.coordinator.decision.checks import POLICED, TRAINING, Level, policy_help
    from cohortgate.coordinator.edge.config import ServeConfig

    described = ServeConfig.model_fields["policy"].description or ""
    assert {c.name for c in TRAINING} == {"audit", "stall"}
    for check in POLICED:
        assert f"{check.name} ({check.default})" in policy_help()
        assert f"{check.name} ({check.default})" in described
        for level in Level:
            assert Policies.parse([f"{check.name}={level}"]).for_job("j")[check.name] is level


def test_ranks_built_from_different_model_configs_are_refused_by_the_model_check() -> None:
    """Signatures agree within every replica group, yet half the ranks built the model from
    another config: the model check refuses, for the layered identity (cause `layout`)."""
    layouts = {r: mesh_layout(r) for r in range(8)}
    configs = {r: config_fingerprint({"hidden": 32 if r < 4 else 33}) for r in range(8)}
    for r, lay in layouts.items():
        layouts[r] = Layout(lay.sizes, lay.position, config=configs[r], pieces=lay.pieces)
    d = decide(cohort(layouts), 1.0, OPTS)
    assert (d.outcome, d.cause, d.check) == (Outcome.REFUSED, Cause.LAYOUT, "model")
    assert [(f.check, f.text, f.ranks) for f in d.findings] == [
        (
            "model",
            f"model_config: {configs[0]} on ranks 0-3, {configs[4]} on ranks 4-7",
            (4, 5, 6, 7),
        )
    ]


def test_tensors_that_do_not_tile_are_named_up_to_the_budget_then_counted() -> None:
    """DETAILED (64) tensors named across the replicas, the rest counted per replica."""

    def broken(rank: int, tensors: int) -> Layout:
        decl = layout(rank, dp=2)
        for t in range(tensors):
            decl.shard(f"t{t:02}", (4,), (0,), (2,))  # the second half held by nobody
        return decl.build()

    d = decide(cohort({0: broken(0, 40), 1: broken(1, 40)}), 1.0, OPTS)
    assert d.outcome is Outcome.REFUSED and len(d.findings) == 65
    assert (d.findings[39].text, d.findings[39].ranks) == (
        "replica dp=0: 't39': uncovered: [2:4] is held by no rank (neighbouring pieces on ranks 0)",
        (0,),
    )
    assert d.findings[63].text.startswith("replica dp=1: 't23': uncovered")
    last = d.findings[64]
    assert (last.check, last.level, last.text, last.ranks) == (
        "coverage",
        Level.STRICT,
        "replica dp=1: 16 more tensors do not tile ('t24', 't25', 't26', 't27', 't28', ...); "
        "the report names the problems of the first 64",
        (),
    )
    d = decide(cohort({0: broken(0, 64), 1: broken(1, 5)}), 1.0, OPTS)
    assert d.findings[-1].text == (  # five: all shown, no ellipsis
        "replica dp=1: 5 more tensors do not tile ('t00', 't01', 't02', 't03', 't04'); the "
        "report names the problems of the first 64"
    )


def test_a_tensor_of_thousands_of_pieces_is_checked_alone_and_named() -> None:
    def rows(rank: int, hole: int) -> Layout:
        decl = layout(rank, dp=2)
        for i in range(4096):  # pieces.LARGE: checked as columns on its own
            if i != hole:
                decl.shard("big", (4096, 2), (i, 0), (1, 2))
        return decl.build()

    d = decide(cohort({0: rows(0, -1), 1: rows(1, 7)}), 1.0, OPTS)
    assert [(f.check, f.level, f.text, f.ranks) for f in d.findings] == [
        (
            "coverage",
            Level.STRICT,
            "replica dp=1: 'big': uncovered: [7:8, 0:2] is held by no rank (neighbouring "
            "pieces on ranks 1)",
            (1,),
        )
    ]


def test_logical_shapes_ranks_disagree_on_are_named_twenty_then_counted() -> None:
    def shapes(rank: int, tensors: int, rows: int) -> Layout:
        decl = layout(rank, dp=2)
        for t in range(tensors):
            decl.replicated(f"w{t:02}", (rows,))
        return decl.build()

    d = decide(cohort({0: shapes(0, 1, 4), 1: shapes(1, 1, 5)}), 1.0, OPTS)
    assert (d.findings[0].check, d.findings[0].level, d.findings[0].text, d.findings[0].ranks) == (
        "coverage",
        Level.STRICT,
        "'w00' logical shape: [4] on rank 0, [5] on rank 1",
        (0, 1),
    )
    d = decide(cohort({0: shapes(0, 23, 4), 1: shapes(1, 23, 5)}), 1.0, OPTS)
    coverage = [f for f in d.findings if f.check == "coverage"]
    assert len(coverage) == 21  # pieces.CONFLICTS_NAMED, then the count
    assert (coverage[-1].level, coverage[-1].text, coverage[-1].ranks) == (
        Level.STRICT,
        "ranks disagree on the logical shapes of 3 more tensors",
        (),
    )
