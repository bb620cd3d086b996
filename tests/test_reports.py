"""Refusal reports word for word: what every rank prints is the product, so each kind of
refusal is pinned whole (headline, report, findings and the ranks they name), not by a
fragment that a changed word, a dropped rank or a swapped level would still match.

Pure decisions (no server): fast, and what `make mutation` runs against the report code."""

from __future__ import annotations

import dataclasses

from cohortgate.coordinator.contract.fingerprint import fields_of
from cohortgate.coordinator.decision.checks import Policies
from cohortgate.coordinator.decision.cohort import CohortState
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import Cause, Finding, Level, Outcome, Verdict
from tests.helpers import manifest_of
from tests.test_agreement import _files, code_state, state
from tests.test_layered import OPTS, cohort, manifest, mesh_layout
from tests.test_verdict_mutants import member

MODEL_ADVICE = (
    "What to do: every rank must build the same model (same code, config and dtype) and, when "
    "sharded, declare its true position and pieces. Fix the ranks named above and relaunch."
)
STRICT = Level.STRICT


def refused(s: CohortState, opts: FormationOptions = OPTS, now: float = 1.0) -> Verdict:
    decision, verdict = judge(s, now, opts)
    assert decision.outcome is Outcome.REFUSED, decision
    assert verdict is not None and verdict.outcome is Outcome.REFUSED
    return verdict


# -- the layout check: where each rank sits ----------------------------------------------
def test_a_mesh_larger_than_the_world() -> None:
    v = refused(cohort({r: mesh_layout(r) for r in range(6)}))
    text = "the mesh tp=2 x dp=2 x pp=2 has 8 positions but the world size is 6"
    assert v.findings == (Finding("layout", STRICT, text, (0, 1, 2, 3, 4, 5)),)
    assert v.cause is Cause.LAYOUT
    assert v.headline == f"layout: ranks 0-5: {text}"
    assert v.report == "\n".join(
        [
            "cohortgate refused to form job 'mesh' round 1: all 6 ranks joined, but their "
            "layered identities disagree.",
            f"strict layout: {text}",
            MODEL_ADVICE,
        ]
    )


def test_a_mesh_of_one_tp_axis_names_only_the_axes_over_one() -> None:
    v = refused(cohort({r: mesh_layout(r, tp=3, pp=1, dp=1) for r in range(2)}))
    assert v.findings[0].text == "the mesh tp=3 has 3 positions but the world size is 2"


def test_a_position_outside_the_mesh_names_the_rank_and_each_axis() -> None:
    lays = {r: mesh_layout(r) for r in range(8)}
    lays[5] = dataclasses.replace(lays[5], position={**lays[5].position, "tp": 2, "pp": 3})
    v = refused(cohort(lays))
    text = "rank 5 declares position tp=2 cp=0 ep=0 dp=0 pp=3, outside the mesh (tp < 2, pp < 2)"
    assert v.findings == (Finding("layout", STRICT, text, (5,)),)
    assert v.headline == f"layout: {text}"  # the text names the rank: not twice
    edge = {r: mesh_layout(r) for r in range(8)}  # the last position inside is not outside
    edge[7] = dataclasses.replace(edge[7], position={**edge[7].position, "dp": 2})
    assert refused(cohort(edge)).findings[0].text == (
        "rank 7 declares position tp=1 cp=0 ep=0 dp=2 pp=1, outside the mesh (dp < 2)"
    )


def test_a_position_held_twice_names_both_holders_in_rank_order() -> None:
    lays = {r: mesh_layout(r) for r in range(8)}
    lays[6] = mesh_layout(6, claimed=2)
    lays[1] = mesh_layout(1, claimed=5)
    v = refused(cohort(lays))
    assert v.findings == (
        Finding(
            "layout",
            STRICT,
            "position tp=1 cp=0 ep=0 dp=0 pp=1 is held by ranks 1,5: every position must be "
            "held exactly once",
            (1, 5),
        ),
        Finding(
            "layout",
            STRICT,
            "position tp=0 cp=0 ep=0 dp=1 pp=0 is held by ranks 2,6: every position must be "
            "held exactly once",
            (2, 6),
        ),
    )
    assert v.headline == f"layout: {v.findings[0].text}"


# -- the model check under a layout: replica groups ----------------------------------------
def test_replica_groups_that_differ_are_counted_and_their_ranks_named() -> None:
    lays = {r: mesh_layout(r) for r in range(8)}
    v = refused(cohort(lays, {3: manifest(33), 7: manifest(33)}))
    assert v.cause is Cause.SIGNATURE_MISMATCH
    assert v.findings == (
        Finding("model", STRICT, "2 replica groups hold differing signatures", (1, 3, 5, 7)),
    )
    assert v.headline == (
        "no majority in replica group tp=1 cp=0 ep=0 pp=0: rank 1 on node0 and rank 3 on node0 "
        "built different models (and 1 more class); compare them to find which one is wrong"
    )
    lines = v.report.splitlines()
    assert lines[:4] == [
        "cohortgate refused to form job 'mesh' round 1: all 8 ranks joined, but their "
        "layered identities disagree.",
        "strict model: 2 replica groups hold differing signatures",
        "replica group tp=1 cp=0 ep=0 pp=0 (ranks that must be identical):",
        f"reference signature {manifest(32).signature_hex()[:12]}: 1 rank [1] on 1 host "
        "node0, 1 tensor",
    ]
    assert lines[-1] == MODEL_ADVICE
    one = refused(cohort(lays, {3: manifest(33)}))
    assert one.findings[0].text == "1 replica group holds differing signatures"


# -- two launches under one job id ---------------------------------------------------------
def test_two_launches_under_one_job_id() -> None:
    m = manifest_of()
    s = CohortState("two-launches", 1, 4, first_join_at=0.0)
    for r in range(4):
        s.add(member(r, m.signature(), m, launch="h:29500" if r < 2 else "h:29501"), 0.0)
    s.manifests[m.signature()] = m
    v = refused(s)
    assert v.cause is Cause.LAUNCH
    assert v.headline == (
        "ranks of 2 launches share job id 'two-launches': launch h:29500 (ranks 0-1 on node0, "
        "node1), launch h:29501 (ranks 2-3 on node2, node3)"
    )
    assert v.report == "\n".join(
        [
            "cohortgate refused to form job 'two-launches' round 1: ranks of 2 different "
            "launches joined under this one job id.",
            "launch h:29500: 2 ranks [0-1] on node0, node1",
            "launch h:29501: 2 ranks [2-3] on node2, node3",
            "What to do: two launches (torchrun store endpoints) share the job id "
            "'two-launches'. Give each launch its own --rdzv-id (or COHORTGATE_JOB), or stop "
            "the stale one, then relaunch.",
        ]
    )


# -- the agreement checks: config, code, facts ---------------------------------------------
def test_several_config_fields_the_first_in_the_headline_and_the_count_of_the_rest() -> None:
    base = {"n_head": "4", "n_layer": "2", "vocab": "100"}
    odd = {"n_head": "8", "n_layer": "3", "vocab": "100"}
    s = state({r: {"config": fields_of(odd if r == 3 else base)} for r in range(4)})
    v = refused(s)
    assert v.cause is Cause.CONFIG
    assert [(f.check, f.level, f.ranks) for f in v.findings] == [("config", STRICT, (3,))] * 2
    assert v.headline == (
        f"ranks disagree on the model config: {v.findings[0].text} (and 1 more)"
    ), v.headline
    one = {"n_head": "8", "n_layer": "2", "vocab": "100"}
    s = state({r: {"config": fields_of(one if r == 3 else base)} for r in range(4)})
    single = refused(s)
    assert single.headline == f"ranks disagree on the model config: {single.findings[0].text}"
    assert single.report.splitlines()[0] == (
        "cohortgate refused to form job 'j' round 1: all 4 ranks joined, but they disagree on "
        "the model config."
    )


def test_many_differing_files_are_listed_up_to_eight_then_counted() -> None:
    import hashlib

    names = [f"pkg/m{i:02}.py" for i in range(11)]
    ref = {n: hashlib.sha256(n.encode()).digest() for n in names}
    other = {n: hashlib.sha256(b"changed" + n.encode()).digest() for n in names[:9]}
    other["pkg/new.py"] = b"\x07" * 32  # imported on rank 3 only
    # m09, m10: not imported on rank 3
    s = code_state({r: other if r == 3 else ref for r in range(4)}, listed=(0, 3))
    strict = FormationOptions(join_deadline_s=60, policies=Policies.parse(["code=strict"]))
    v = refused(s, strict)
    shown = ", ".join(names[:8])
    assert v.headline == (
        "ranks run different training code: code.modules: 12 files differ: "
        f"{shown} and 4 more on rank 3 (node1), against ranks 0-2 (node0, node1)"
    ), v.headline
    few = {**ref, "pkg/m10.py": b"\x01" * 32}
    del few["pkg/m09.py"]
    v = refused(code_state({r: few if r == 3 else ref for r in range(4)}, (0, 3)), strict)
    assert v.headline == (
        "ranks run different training code: code.modules: 2 files differ: pkg/m09.py (not "
        "imported here), pkg/m10.py on rank 3 (node1), against ranks 0-2 (node0, node1)"
    ), v.headline
    eight = {
        r: ({**ref, **dict.fromkeys(names[:8], b"\x02" * 32)} if r == 3 else ref) for r in range(4)
    }
    assert refused(code_state(eight, (0, 3)), strict).headline.endswith(
        f"8 files differ: {shown} on rank 3 (node1), against ranks 0-2 (node0, node1)"
    )


# -- runtime ---------------------------------------------------------------------------------
def test_a_runtime_refusal_names_its_checks_in_the_reason() -> None:
    runtime = {
        r: {"device_type": "cuda", "nccl_version": "2.21.5", "torch_version": "2.13.0"}
        for r in range(8)
    }
    runtime[6] = dict(runtime[6], nccl_version="2.18.1", device_type="cpu")
    decision, verdict = judge(
        cohort({r: mesh_layout(r) for r in range(8)}, runtime=runtime), 1.0, OPTS
    )
    assert (
        decision.reason
        == "[8/8 ranks joined; runtimes disagree: runtime.device_type, runtime.nccl]"
    )
    assert verdict is not None and [f.ranks for f in verdict.findings] == [(6,), (6,)]


def test_a_config_that_built_other_models_leads_with_the_config_then_the_models() -> None:
    base, odd = {"n_head": "4"}, {"n_head": "8"}
    s = state(
        {r: {"config": fields_of(odd if r == 3 else base)} for r in range(4)},
        built={3: manifest_of(width=8)},
    )
    v = refused(s)
    assert v.cause is Cause.CONFIG
    assert (
        v.headline
        == "ranks disagree on the model config: config.n_head: 4 on ranks 0-2, 8 on rank 3"
    )
    assert v.report.splitlines()[0] == (
        "cohortgate refused to form job 'j' round 1: all 4 ranks joined, but they disagree on "
        "the model config, and so built 2 different models (the shape differences below follow "
        "from it)."
    )


def test_a_file_list_from_one_side_only_still_says_the_files_were_not_named() -> None:
    # rank 0's list came (its class's), rank 3's never did
    s = code_state({r: _files("model/attn.py" if r == 3 else "") for r in range(4)}, (0,))
    opts = FormationOptions(
        join_deadline_s=60, manifest_timeout_s=5, policies=Policies.parse(["code=strict"])
    )
    assert judge(s, 1.0, opts)[0].outcome is Outcome.WAITING  # its list is asked for
    assert refused(s, opts, now=6.0).headline == (
        "ranks run different training code: code.modules: files not named (their ranks did not "
        "send the list in time) on rank 3 (node1), against ranks 0-2 (node0, node1)"
    )


def test_layout_fields_that_differ_name_the_odd_rank_and_the_reason_the_checks() -> None:
    lays = {r: mesh_layout(r) for r in range(8)}
    lays[3] = dataclasses.replace(lays[3], sizes={**lays[3].sizes, "dp": 4, "pp": 1}, dtype="bf16")
    decision, v = judge(cohort(lays), 1.0, OPTS)
    assert decision.reason == "[8/8 ranks joined; layered identity: layout, model]"
    assert v is not None and v.findings == (
        Finding("layout", STRICT, "dp_size: 2 on ranks 0-2,4-7, 4 on rank 3", (3,)),
        Finding("layout", STRICT, "pp_size: 2 on ranks 0-2,4-7, 1 on rank 3", (3,)),
        Finding("model", STRICT, "dtype: (none) on ranks 0-2,4-7, bf16 on rank 3", (3,)),
    )
    assert v.headline == "layout: dp_size: 2 on ranks 0-2,4-7, 4 on rank 3"
    assert v.cause is Cause.LAYOUT  # the layout's words lead, not the replica classes'


def test_a_mesh_of_one_position_for_two_ranks() -> None:
    from cohortgate.coordinator.contract.layout import Layout

    v = refused(cohort({r: Layout({"tp": 1}, {"tp": 0}) for r in range(2)}))
    assert v.findings == (
        Finding("layout", STRICT, "the mesh has 1 position but the world size is 2", (0, 1)),
    )


def test_a_headline_names_the_ranks_unless_its_text_names_exactly_them() -> None:
    from cohortgate.coordinator.decision.checks.runtime import RUNTIME_CHECKS

    check = RUNTIME_CHECKS[1]  # runtime.nccl: the shared headline of findings

    def headline(text: str, ranks: tuple[int, ...]) -> str:
        return check.strict_headline([Finding(check.name, STRICT, text, ranks)])

    assert headline("x on rank 1", (1,)) == "runtime.nccl: x on rank 1"
    assert headline("x on rank 12", (1,)) == "runtime.nccl: rank 1: x on rank 12"
    assert headline("x on ranks 0-5,7", (0, 1, 2, 3, 4, 5)) == (
        "runtime.nccl: ranks 0-5: x on ranks 0-5,7"
    )
    assert headline("x on ranks 0-5, y on rank 6", (0, 1, 2, 3, 4, 5)) == (
        "runtime.nccl: x on ranks 0-5, y on rank 6"
    )
    assert headline("no ranks named", ()) == "runtime.nccl: no ranks named"
