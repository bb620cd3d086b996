"""The decision and the verdict asserted whole (decision/formation.py `decide`, report.py
`build_verdict`/`judge`): every field a rank receives or the service acts on, for each way a
round ends or waits: who it is (job, round, world size, the cohort id), when (decided_at, the
time to look again), why (the reason, the ranks present and missing, the classes), and rank
0's endpoint. Each assertion here killed a mutant of the decision's central functions that
the rest of the suite let through (a field dropped or set to None, a wait with no time to
look again, a one-launch job taken for two)."""

from __future__ import annotations

import re

from cohortgate.coordinator.contract.layout import Layout
from cohortgate.coordinator.decision.checks import Policies
from cohortgate.coordinator.decision.cohort import CohortState, Member, UploadKind
from cohortgate.coordinator.decision.formation import FormationOptions, decide, uploads_due
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.decision.verdict import Cause, Finding, Level, Outcome
from tests.helpers import manifest_of, member_of

MODEL = manifest_of()
OTHER = manifest_of(width=8)
OPTS = FormationOptions(join_deadline_s=60, manifest_timeout_s=20)
FIRST, NOW = 1000.0, 1005.0  # realistic clocks: a time taken for a duration shows


def cohort(world: int, joined: int | None = None, **kw: object) -> CohortState:
    """A round of `world` ranks of one launch, the first `joined` of them in (all: every
    manifest is in too)."""
    state = CohortState("whole", 3, world, first_join_at=FIRST)
    for r in range(world if joined is None else joined):
        state.add(rank(r, **kw), FIRST + r)
    if joined is None:
        state.manifests[MODEL.signature()] = MODEL
    return state


def rank(r: int, **kw: object) -> Member:
    return member_of(r, MODEL, launch="tcp://store:29500", **kw)


def two_models() -> CohortState:
    """Two ranks, rank 1's model wider than rank 0's, both manifests in."""
    state = cohort(2)
    state.remove(state.members[1], NOW)
    state.add(member_of(1, OTHER, launch="tcp://store:29500"), FIRST + 1)
    state.manifests[OTHER.signature()] = OTHER
    return state


def test_a_formed_verdict_says_who_when_why_and_hands_out_rank_0s_endpoint() -> None:
    state = cohort(4)
    decision, verdict = judge(state, NOW, OPTS)
    assert decision.outcome is Outcome.FORMED, "one launch of one job is not two launches"
    assert verdict is not None
    assert (verdict.outcome, verdict.job_id, verdict.round, verdict.world_size) == (
        Outcome.FORMED,
        "whole",
        3,
        4,
    )
    assert re.fullmatch(r"whole/3/[0-9a-f]{8}", verdict.cohort_id)
    assert verdict.reason == "[4/4 ranks joined, 1 signature]"
    assert verdict.decided_at == NOW
    assert verdict.init_method == "tcp://127.0.0.1:29999"
    assert (verdict.classes, verdict.findings, verdict.missing_ranks) == ((), (), ())


def test_a_round_missing_ranks_waits_until_its_deadline_then_names_who_was_there() -> None:
    state = cohort(4, joined=3)
    waiting = decide(state, NOW, OPTS)
    assert (waiting.outcome, waiting.reason) == (Outcome.WAITING, "[3/4 ranks joined]")
    assert waiting.recheck_at == FIRST + 60, "a wait that never looks again never refuses"
    decision, verdict = judge(state, FIRST + 60, OPTS)
    assert decision.outcome is Outcome.REFUSED and verdict is not None
    assert (verdict.outcome, verdict.cause, verdict.job_id, verdict.round) == (
        Outcome.REFUSED,
        Cause.DEADLINE,
        "whole",
        3,
    )
    assert verdict.reason == (
        "[join deadline of 60s passed with 3/4 ranks joined; missing ranks 3]"
    )
    assert (verdict.missing_ranks, verdict.present_ranks) == ((3,), (0, 1, 2))
    assert verdict.decided_at == FIRST + 60 and verdict.world_size == 4
    assert verdict.init_method == "", "a refused round hands out no endpoint"


def test_two_launches_under_one_job_id_are_refused_at_once_naming_the_ranks_present() -> None:
    state = cohort(4, joined=2)
    state.add(member_of(2, MODEL, launch="tcp://elsewhere:29500"), FIRST + 2)
    decision, verdict = judge(state, NOW, OPTS)
    assert decision.outcome is Outcome.REFUSED and verdict is not None
    assert decision.reason == "[ranks of 2 launches joined under one job id]"
    assert decision.cause is Cause.LAUNCH
    assert verdict.present_ranks == (0, 1, 2) and verdict.missing_ranks == ()


def test_invalid_uploads_of_two_kinds_are_both_counted_in_the_reason() -> None:
    state = cohort(2)
    state.invalid_uploads[(UploadKind.MANIFEST, b"s")] = "bad"
    state.invalid_uploads[(UploadKind.DIGESTS, b"d1")] = "bad"
    state.invalid_uploads[(UploadKind.DIGESTS, b"d2")] = "bad"
    decision = decide(state, NOW, OPTS)
    assert (decision.outcome, decision.cause) == (Outcome.REFUSED, Cause.MANIFEST_INVALID)
    assert decision.reason == (
        "[1 uploaded manifest(s) did not hash to the signature their rank joined with; "
        "2 uploaded per-tensor digest list(s) did not combine to the weights digest their "
        "rank joined with]"
    )


def test_a_wait_for_one_manifest_says_one_signature_and_looks_again_at_the_upload_timeout() -> None:
    state = cohort(2, joined=2)
    decision = decide(state, NOW, OPTS)
    assert decision.outcome is Outcome.WAITING
    assert decision.reason == "[2/2 ranks joined, 1 signature, waiting for 1 manifest(s)]"
    assert decision.recheck_at == FIRST + 1 + 20 == uploads_due(state, NOW, OPTS)


def test_a_wait_for_digests_looks_again_at_the_upload_timeout() -> None:
    opts = FormationOptions(manifest_timeout_s=20, policies=Policies.parse(["weights=strict"]))
    state = cohort(2, weights_digest=b"a" * 32)
    state.members[1] = rank(1, weights_digest=b"b" * 32)
    decision = decide(state, NOW, opts)
    assert decision.outcome is Outcome.WAITING and decision.awaiting_digests
    assert decision.recheck_at == FIRST + 1 + 20


def test_two_models_under_model_warn_form_with_the_warning_said() -> None:
    state = two_models()
    decision = decide(state, NOW, FormationOptions(policies=Policies.parse(["model=warn"])))
    assert decision.outcome is Outcome.FORMED
    assert decision.findings == (Finding("model", Level.WARN, "2 different signatures"),)


def test_a_check_turned_off_does_not_stop_the_checks_after_it() -> None:
    state = cohort(2, runtime={"device_type": "cuda"})
    state.members[1] = rank(1, runtime={"device_type": "cpu"})
    opts = FormationOptions(policies=Policies.parse(["model=off"]))
    decision, verdict = judge(state, NOW, opts)
    assert (decision.outcome, decision.check) == (Outcome.REFUSED, "runtime.device_type")
    assert verdict is not None and verdict.classes == (), "no check named signature classes"


def test_a_runtime_field_a_rank_does_not_send_counts_as_sent_empty() -> None:
    """An agent too old to know a field sends none; a newer one with nothing to say sends
    "": the same, named as "(none)" beside the ranks that say something."""
    state = cohort(3, runtime={"device_type": "cpu", "cuda_version": "12.1", "nccl_version": ""})
    state.members[1] = rank(
        1, runtime={"device_type": "cpu", "cuda_version": "", "nccl_version": ""}
    )
    state.members[2] = rank(2, runtime={"device_type": "cpu"})
    decision = decide(state, NOW, FormationOptions())
    assert decision.outcome is Outcome.FORMED
    assert decision.findings == (
        Finding(
            "runtime.cuda", Level.WARN, "cuda_version: 12.1 on rank 0, (none) on ranks 1-2", (0,)
        ),
    )


def test_weights_are_not_compared_once_an_earlier_check_refuses() -> None:
    """The weights check waits for per-tensor digests to name what differs: after a
    refusal it must not run, or the refusal would wait on digests it does not need."""
    opts = FormationOptions(policies=Policies.parse(["weights=strict"]))
    state = cohort(2, runtime={"device_type": "cuda"}, weights_digest=b"a" * 32)
    state.members[1] = rank(1, runtime={"device_type": "cpu"}, weights_digest=b"b" * 32)
    decision = decide(state, NOW, opts)
    assert (decision.outcome, decision.check) == (Outcome.REFUSED, "runtime.device_type")
    assert [f.check for f in decision.findings] == ["runtime.device_type"]


def test_a_rank_without_a_layout_among_ranks_with_one_is_named_whole() -> None:
    state = cohort(4)
    lay = Layout({"dp": 4}, {"dp": 0})
    for r in range(3):
        state.members[r] = rank(r, layout=Layout(lay.sizes, {"dp": r}))
    decision = decide(state, NOW, FormationOptions())
    assert decision.outcome is Outcome.REFUSED
    assert decision.findings[0] == Finding(
        "layout",
        Level.STRICT,
        "ranks 3 declared no layout while ranks 0-2 did: every rank must declare one",
        (3,),
    )


def test_a_refused_verdict_carries_the_signature_classes_it_was_refused_for() -> None:
    state = two_models()
    decision, verdict = judge(state, NOW, OPTS)
    assert (decision.outcome, decision.cause) == (Outcome.REFUSED, Cause.SIGNATURE_MISMATCH)
    assert verdict is not None and len(verdict.classes) == 2
    assert verdict.classes == decision.classes
    assert [c.ranks for c in verdict.classes] == [(0,), (1,)]
