"""Audits during training, the pure part (decision/audit.py): which steps are compared, who
is asked for per-tensor digests, what the report says, when a strict job stops."""

from __future__ import annotations

import hashlib

import pytest

from cohortgate.coordinator.decision.audit import (
    MARGIN_STEPS,
    MAX_MARGIN_STEPS,
    MAX_OPEN_STEPS,
    TENSORS_WAIT_S,
    Answer,
    CohortAudits,
    RankAudit,
)
from cohortgate.coordinator.decision.verdict import AuditFinding, Level

COHORT = "job/1/abcd1234"
NAMES = ("0.weight", "0.bias", "2.weight", "2.bias")


def h(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def tensors(step: int, changed: str = "") -> tuple[tuple[str, bytes], ...]:
    return tuple((n, h(n, step, n == changed)) for n in NAMES)


def audit(rank: int, step: int, digest: bytes, world: int = 4, **kw: object) -> RankAudit:
    return RankAudit(
        cohort_id=COHORT,
        job_id="job",
        round=1,
        rank=rank,
        world_size=world,
        host=f"host{rank // 2}",
        incarnation=f"i{rank}",
        step=step,
        digest=digest,
        **kw,  # type: ignore[arg-type]
    )


def cohort(level: Level = Level.WARN, world: int = 4) -> CohortAudits:
    c = CohortAudits(COHORT, "job", world, level)
    c.hosts.update({r: f"host{r // 2}" for r in range(world)})  # the formed cohort's hosts
    return c


def run_steps(c: CohortAudits, steps: range, odd: dict[int, int], t0: float = 0.0) -> None:
    """Every rank audits each step 0.2 s apart; odd[rank] = the step its weights changed."""
    for s in steps:
        for rank in range(c.world_size):
            flipped = rank in odd and s >= odd[rank]
            c.add(audit(rank, s, h("all", s, flipped and rank)), t0 + 0.2 * s)


def send_tensors(c: CohortAudits, now: float, changed: dict[int, str]) -> None:
    """The ranks the answer asks for send their per-tensor digests of the asked step."""
    for rank, step in c.answer().tensors_for:
        c.add(audit(rank, step, b"", tensors=tensors(step, changed.get(rank, ""))), now)


def test_clean_steps_are_compared_once_all_ranks_sent_and_give_no_finding() -> None:
    c = cohort()
    run_steps(c, range(20), {})
    assert c.compared == 20 and c.last_compared == 19 and not c.steps
    assert c.findings == [] and c.answer().tensors_for == () and c.answer().report == ""


def test_a_rank_that_changed_is_asked_about_then_named_with_host_tensor_and_step() -> None:
    c = cohort()
    run_steps(c, range(8), {2: 5})
    # One rank of each digest class is asked for its per-tensor digests of step 5.
    assert c.answer().tensors_for == ((0, 5), (2, 5))
    assert c.findings == []  # the report waits for them
    send_tensors(c, 2.0, {2: "2.weight"})
    (found,) = c.findings
    assert (found.kind, found.step, found.level, found.stop_step) == ("diverged", 5, "warn", 0)
    assert found.headline == (
        "replicas diverged at step 5: rank 2 on host1 differs from ranks 0-1,3 in 2.weight"
    )
    assert "differs:   rank 2 on host1" in found.report
    assert "1 tensor of 4 differs: 2.weight (rank 2 against rank 0)" in found.report
    assert "The job goes on (audit policy warn)" in found.report
    answer = c.answer()
    assert (answer.headline, answer.diverged_step, answer.stop_step) == (found.headline, 5, 0)
    assert answer.tensors_for == ()


def test_the_same_divergence_standing_is_reported_once() -> None:
    c = cohort()
    run_steps(c, range(8), {2: 5})
    send_tensors(c, 2.0, {2: "2.weight"})
    run_steps(c, range(8, 30), {2: 5})
    assert [f.kind for f in c.findings] == ["diverged"]
    assert c.answer().tensors_for == ()


def test_strict_picks_one_stop_step_ahead_of_the_fastest_rank_for_every_rank() -> None:
    c = cohort(Level.STRICT)
    run_steps(c, range(8), {2: 5})
    c.add(audit(1, 8, h("all", 8, False)), 1.6)  # rank 1 ran ahead
    send_tensors(c, 1.7, {2: "2.weight"})
    (found,) = c.findings
    # 0.2 s a step: a quarter second ahead is 2 steps past the fastest rank's step 8, and
    # two audits on (every step is audited: 2 more).
    assert found.stop_step == 8 + 2 + 2 >= 8 + MARGIN_STEPS
    assert f"stops the job at step {found.stop_step}" in found.report
    assert c.answer().stop_step == found.stop_step


def test_strict_at_a_fast_pace_stops_within_a_quarter_second_of_steps() -> None:
    """10 ms a step: the stop lands 25 steps (a quarter second) past the fastest rank, plus
    two audits, not 100 steps on: a job of 30 steps reaches it."""
    c = cohort(Level.STRICT)
    for s in range(8):
        for rank in range(4):
            c.add(audit(rank, s, h("all", s, rank == 2 and s >= 5)), 0.01 * s)
    send_tensors(c, 0.09, {2: "2.weight"})
    (found,) = c.findings
    assert found.stop_step == 7 + 25 + 2


def test_the_words_agree_with_their_numbers() -> None:
    """ "both ranks", not "all 2 ranks"; "1 tensor of 4 differs", "2 tensors of 4 differ"."""
    c = cohort(world=2)
    for s in range(3):
        for rank in (0, 1):
            c.add(audit(rank, s, h("all", s, rank == 1 and s == 2)), 0.2 * s)
    c.add(audit(0, 2, b"", tensors=tensors(2)), 0.5)
    c.add(
        audit(1, 2, b"", tensors=tuple((n, h(n, "flip")) for n in NAMES[:2]) + tensors(2)[2:]), 0.5
    )
    (found,) = c.findings
    assert "both ranks must hold the same values" in found.report
    assert "2 tensors of 4 differ: 0.weight, 0.bias" in found.report


def test_the_answer_says_which_steps_are_compared() -> None:
    """A closing rank waits until its last step is compared: compared_until is one past it."""
    c = cohort()
    assert c.answer().compared_until == 0
    run_steps(c, range(3), {})
    assert c.answer().compared_until == 3
    c.add(audit(0, 3, h("all", 3, False)), 1.0)  # step 3 is open: one rank sent it
    assert c.answer().compared_until == 3


def test_under_a_layout_only_ranks_of_one_replica_group_are_compared() -> None:
    c = cohort()
    groups = {0: "tp=0", 1: "tp=1", 2: "tp=0", 3: "tp=1"}
    for s in range(3):  # tp slices hold different weights: no finding
        for rank in range(4):
            c.add(audit(rank, s, h("slice", rank % 2), group=groups[rank]), 0.2 * s)
    assert c.findings == [] and c.compared == 3
    for rank in range(4):
        digest = h("slice", rank % 2, rank == 3)
        c.add(audit(rank, 3, digest, group=groups[rank]), 0.6)
    assert c.answer().tensors_for == ((1, 3), (3, 3))  # group tp=1 only
    send_tensors(c, 0.7, {3: "0.bias"})
    (found,) = c.findings
    assert "replica group tp=1 (ranks that must hold the same values)" in found.report
    assert "no majority in replica group tp=1: rank 1 on host0 and rank 3 on host1" in (
        found.headline
    )
    assert "tp=0" not in found.report


def test_a_rank_that_does_not_send_is_named_at_the_bound_not_waited_for() -> None:
    c, t0 = cohort(Level.STRICT), 1000.0  # a clock that reads like one
    for s in range(3):
        for rank in (0, 1, 3):
            c.add(audit(rank, s, h("all", s)), t0 + 0.25 * s)
    assert c.compared == 0  # waiting for rank 2
    assert c.due(60.0) == t0 + 60.0  # the oldest step's bound
    c.sweep(t0 + 59.9, bound_s=60.0)
    assert c.compared == 0
    c.sweep(t0 + 60.0, bound_s=60.0)  # at the bound: step 0 only
    assert (c.compared, c.due(60.0)) == (1, t0 + 60.25)
    c.sweep(t0 + 61.0, bound_s=60.0)
    assert c.compared == 3 and c.due(60.0) is None
    (found,) = c.findings  # the same ranks missing again is not a new finding
    assert found == AuditFinding(
        "job",
        COHORT,
        0,
        "missing",
        "strict",
        "step 0: rank 2 on host1 sent no audit in time",
        f"cohortgate audit of job 'job' (cohort {COHORT}): step 0: rank 2 on host1 sent no "
        "audit in time; the step was compared across the 3 ranks that did.\n"
        "What to do: a rank that stops auditing is hung, dead or no longer calls "
        "cohort.audit(); look at those ranks' hosts.",
        t0 + 60.0,
    )


def test_per_tensor_digests_that_never_come_still_give_a_report() -> None:
    c = cohort()
    run_steps(c, range(7), {2: 5})
    c.add(audit(0, 5, b"", tensors=tensors(5)), 1.3)  # rank 2 never answers
    assert c.due(60.0) == 1.0 + TENSORS_WAIT_S  # found when step 5 came in whole, at 1.0
    c.sweep(1.0 + TENSORS_WAIT_S - 0.1, bound_s=60.0)
    assert c.findings == []
    c.sweep(1.0 + TENSORS_WAIT_S, bound_s=60.0)
    (found,) = c.findings
    assert (found.kind, found.step, found.at) == ("diverged", 5, 1.0 + TENSORS_WAIT_S)
    assert "rank 2 did not send its per-tensor digests: tensors not named" in found.report
    assert found.headline.endswith("differs from ranks 0-1,3")


def test_a_restored_divergence_is_told_again_with_its_stop_step_and_not_found_anew() -> None:
    first = cohort(Level.STRICT)
    run_steps(first, range(8), {2: 5})
    send_tensors(first, 1.6, {2: "2.weight"})
    (found,) = first.findings
    again = cohort(Level.STRICT)  # a restarted coordinator, from its history
    again.restore(found)
    run_steps(again, range(8, 12), {2: 5})
    assert again.findings == [found]  # restored; the same ranks differing is no new finding
    answer = again.answer()
    assert (answer.stop_step, answer.report) == (found.stop_step, found.report)


def test_steps_held_open_are_bounded_by_a_stalled_rank() -> None:
    c = cohort()
    for s in range(MAX_OPEN_STEPS + 10):
        for rank in (0, 1, 2):  # rank 3 is stalled
            c.add(audit(rank, s, h("all", s)), 0.01 * s)
    assert len(c.steps) == MAX_OPEN_STEPS
    assert c.last_compared == 9
    assert [f.headline for f in c.findings] == ["step 0: rank 3 on host1 sent no audit in time"]


@pytest.mark.parametrize("late_step", [0, 3, 4])  # 4: the last step compared
def test_a_rank_that_comes_back_late_for_a_compared_step_changes_nothing(late_step: int) -> None:
    c = cohort()
    for s in range(5):
        for rank in (0, 1, 2):
            c.add(audit(rank, s, h("all", s)), 0.2 * s)
    c.sweep(100.0, bound_s=60.0)
    c.add(audit(3, late_step, h("other")), 100.1)
    assert not c.steps and [f.kind for f in c.findings] == ["missing"]


def test_audits_every_10th_step_push_the_stop_two_audits_ahead() -> None:
    """COHORTGATE_AUDIT_EVERY=10: a rank hears of the stop in the answer to its next
    audit, 10 steps on, so the stop lands past the one after."""
    c = cohort(Level.STRICT)
    for s in range(0, 80, 10):
        for rank in range(4):
            c.add(audit(rank, s, h("all", s, rank == 2 and s >= 50)), 0.02 * s)
    send_tensors(c, 1.6, {2: "2.weight"})
    (found,) = c.findings
    assert found.step == 50
    # 0.02 s a step: a quarter second is 13 steps; then two audits of 10 steps each.
    assert found.stop_step == 70 + 13 + 20


def test_the_status_lines_put_a_divergence_first_then_missing_ranks_then_the_latest() -> None:
    """`Audits.status()` (the status page and /status.json): one line per audited cohort,
    diverged first, then missing ranks, then the most recently audited; `shown` bounds it."""
    from cohortgate.coordinator.decision.formation import FormationOptions
    from cohortgate.coordinator.service.audits import Audits
    from cohortgate.coordinator.service.observers import Observer
    from cohortgate.coordinator.state.backends import open_verdicts

    audits = Audits(FormationOptions(), open_verdicts(None), Observer(), clock=lambda: 0.0)
    quiet, diverged, missing, recent = cohort(), cohort(), cohort(), cohort()
    for name, c, seen in [("quiet", quiet, 1.0), ("diverged", diverged, 0.5)]:
        c.cohort_id, c.job_id, c.last_seen = f"{name}/1/x", name, seen
    missing.cohort_id, missing.job_id, missing.last_seen, missing.missing = "m/1/x", "m", 0.2, (3,)
    recent.cohort_id, recent.job_id, recent.last_seen = "r/1/x", "r", 9.0
    diverged.diverged_step, diverged.stop_step, diverged.headline = 5, 7, "rank 2 differs"
    quiet.last_step, quiet.last_compared = 12, 11
    for c in (quiet, diverged, missing, recent):
        audits.cohorts[c.cohort_id] = c
    lines = audits.status()
    assert [line["job_id"] for line in lines] == ["diverged", "m", "r", "quiet"]
    assert lines[0] == {
        "job_id": "diverged",
        "cohort_id": "diverged/1/x",
        "level": "warn",
        "ranks": 4,
        "last_step": diverged.last_step,
        "last_compared": diverged.last_compared,
        "diverged_step": 5,
        "stop_step": 7,
        "headline": "rank 2 differs",
        "missing": [],
    }
    assert lines[1]["missing"] == [3]
    assert (lines[3]["last_step"], lines[3]["last_compared"]) == (12, 11)
    assert [line["job_id"] for line in audits.status(shown=2)] == ["diverged", "m"]


@pytest.mark.parametrize(
    ("times", "margin"),
    [
        ({0: 0.0}, MARGIN_STEPS),  # one step: no pace yet
        ({0: 0.0, 1: 0.02}, 13 + 2),  # two: 20 ms a step, a quarter second is 13 steps
        ({0: 0.0, 1: 1.0}, MARGIN_STEPS + 2),  # 1 s a step: at least MARGIN_STEPS
        ({0: 0.0, 2: 0.0, 4: 0.0, 6: 0.0}, MAX_MARGIN_STEPS + 2 * 2),  # no time passed
        # the pace of the last 8 steps only: four slow steps, then eight at 20 ms (13 steps)
        ({**{s: float(s) for s in range(4)}, **{s: 4 + (s - 4) * 0.02 for s in range(4, 12)}}, 15),
    ],
)
def test_the_stop_margin_follows_the_pace_of_the_last_steps(
    times: dict[int, float], margin: int
) -> None:
    """Steps in MARGIN_S at the pace the last 8 audited steps arrived (two audits more), on a
    clock that reads like one."""
    c = cohort(Level.STRICT)
    for step, at in times.items():
        c.add(audit(0, step, h("all", step)), 1000.0 + at)
    assert c._margin() == margin


def test_a_message_of_per_tensor_digests_alone_is_not_a_ranks_audit_of_its_step() -> None:
    c = cohort()
    for rank in (0, 1, 3):
        c.add(audit(rank, 5, h("all", 5)), 1.0)
    c.add(audit(2, 5, b"", tensors=tensors(5)), 1.1)  # unasked, digest-less: not its audit
    assert (c.compared, sorted(c.steps[5].digests)) == (0, [0, 1, 3])


def test_a_strict_divergence_is_reported_whole_when_its_tensors_arrive() -> None:
    c = cohort(Level.STRICT)
    assert c.answer() == Answer(COHORT, "strict")  # nothing found yet: every field at rest
    run_steps(c, range(8), {2: 5}, t0=1000.0)
    send_tensors(c, 1002.0, {2: "2.weight"})
    (found,) = c.findings
    assert (found.at, found.stop_step) == (1002.0, 11)  # when the last tensors came
    reference, odd = h("all", 5, False).hex()[:12], h("all", 5, 2).hex()[:12]
    assert found.report == (
        f"cohortgate audit of job 'job' (cohort {COHORT}): replicas that must hold the same "
        "weights differ at step 5.\n"
        "all 4 ranks must hold the same values (no layout):\n"
        f"  reference: ranks 0-1,3 on host0, host1, digest {reference}\n"
        f"  differs:   rank 2 on host1, digest {odd}\n"
        "    1 tensor of 4 differs: 2.weight (rank 2 against rank 0)\n"
        "The strict policy stops the job at step 11: every rank's cohort.audit() raises "
        "ReplicasDiverged there, before a checkpoint holds the corrupted weights.\n"
        "What to do: a rank's weights changed without the others' (a bit flip or silent data "
        "corruption on its GPU, an update applied on one rank only). Take the named host out "
        "of service, and resume from a checkpoint saved before step 5."
    )


def test_a_divergence_that_cleared_and_came_back_is_reported_again() -> None:
    """Rank 2 differs at step 5, is loaded from a checkpoint and agrees from step 8, then
    differs again at step 12: the same ranks, a new divergence."""
    c = cohort()
    for s in range(16):
        for rank in range(4):
            odd = rank == 2 and (5 <= s < 8 or s >= 12)
            c.add(audit(rank, s, h("all", s, odd)), 0.2 * s)
        if s in (5, 12):
            send_tensors(c, 0.2 * s + 0.1, {2: "2.weight"})
    assert [(f.kind, f.step) for f in c.findings] == [("diverged", 5), ("diverged", 12)]


def test_a_split_without_a_majority_with_a_cut_list_of_many_tensors_is_worded_whole() -> None:
    names = tuple(f"t{i}" for i in range(12))
    c = cohort()
    for s in range(8):
        for rank in range(4):
            c.add(audit(rank, s, h("all", s, rank >= 2 and s >= 5)), 1000 + 0.2 * s)
    for rank, step in c.answer().tensors_for:
        odd = rank >= 2
        sent = tuple((n, h(n, odd)) for n in names)
        c.add(audit(rank, step, b"", tensors=sent, truncated=odd), 1002.0)
    (found,) = c.findings
    assert (found.cohort_id, found.headline) == (
        COHORT,
        "replicas diverged at step 5: no majority: ranks 0-1 on host0 and ranks 2-3 on host1 "
        "hold different weights in t0",
    )
    assert (
        "\n  differs:   ranks 2-3 on host1, digest "
        f"{h('all', 5, True).hex()[:12]}\n"
        "    12 tensors of 12 differ (of the tensors sent; the list was cut): t0, t1, t2, t3, "
        "t4, t5, t6, t7 and 4 more (rank 2 against rank 0)\n"
        "The job goes on (audit policy warn); --policy audit=strict stops it.\n"
    ) in found.report


def test_per_tensor_digests_that_agree_say_the_difference_is_past_them() -> None:
    c = cohort()
    run_steps(c, range(8), {2: 5})
    send_tensors(c, 2.0, {})  # rank 2's tensors sent agree with rank 0's
    (found,) = c.findings
    assert (
        f"  differs:   rank 2 on host1, digest {h('all', 5, 2).hex()[:12]}\n"
        "    (their per-tensor digests agree: the difference is past the tensors sent)\n"
    ) in found.report
