"""Stalls over real gRPC: a real coordinator, a cohort formed by real join streams, then step
marks as the agent sends them (in Audit calls), the snapshots it asks for, and hostile marks."""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from tests.helpers import InProcessCoordinator, metric_total
from tests.test_audits_grpc import formed, list_audits, refused, send

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def coordinator() -> Iterator[InProcessCoordinator]:
    c = InProcessCoordinator(join_deadline=20, stall_after="2")
    try:
        yield c
    finally:
        c.stop()


def mark(v: pb.Verdict, rank: int, step: int, **kw: object) -> pb.RankAudit:
    """Rank `rank`'s step mark, as the agent's background thread sends it."""
    fields: dict[str, object] = {
        "cohort_id": v.cohort_id,
        "job_id": v.job_id,
        "round": v.round,
        "rank": rank,
        "world_size": v.world_size,
        "host": f"host{rank // 2}",
        "incarnation": f"i{rank}",
        "step": step,
        "step_only": True,
    }
    return pb.RankAudit(**{**fields, **kw})  # type: ignore[arg-type]


def cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cohortgate.coordinator.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def snapshot(where: str, call: str = "") -> pb.StackSnapshot:
    return pb.StackSnapshot(where=where, call=call, frames=[f"{where} frame"])


def status_stalls(c: InProcessCoordinator) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"{c.metrics_url}/status.json", timeout=5) as answer:
        return list(json.load(answer)["stalls"])


def beat_until(
    addr: str, v: pb.Verdict, steps: dict[int, int], wanted: str, within: float = 15
) -> pb.AuditAnswer:
    """Every rank beats (its step unchanged) every 0.2 s until an answer has `wanted` set."""
    give_up = time.monotonic() + within
    while True:
        (answer,) = send(addr, *(mark(v, r, s) for r, s in steps.items())).answers
        if getattr(answer, wanted):
            return answer
        assert time.monotonic() < give_up, f"no {wanted} within {within} s"
        time.sleep(0.2)


def test_a_stall_asks_for_snapshots_and_reports_the_odd_rank_first(
    coordinator: InProcessCoordinator,
) -> None:
    addr = coordinator.addr
    v = formed(addr, "stall-grpc")
    for step in range(3):
        (answer,) = send(addr, *(mark(v, r, step) for r in range(4))).answers
        assert (answer.snapshot_wanted, answer.stall_id) == (0, 0)
    # no new step: after --stall-after 2 the ranks are asked where they are
    asked = beat_until(addr, v, dict.fromkeys(range(4), 2), "snapshot_wanted")
    places = {r: snapshot("train (train.py:88)", "all_reduce") for r in (0, 1, 3)}
    places[2] = snapshot("wait_for_batch (data.py:31)")
    for r, snap in places.items():
        send(addr, mark(v, r, 2, stall_id=asked.snapshot_wanted, snapshot=snap))
    told = beat_until(addr, v, dict.fromkeys(range(4), 2), "stall_id")
    assert told.stall_headline.startswith("stalled at step 2 for ")
    assert told.stall_headline.endswith(
        ": rank 2 on host1 in wait_for_batch (data.py:31); ranks 0-1,3 in all_reduce (train.py:88)"
    ), told.stall_headline
    assert "wait_for_batch (data.py:31) frame" in told.stall_report
    assert not told.stall_stop  # warn, the default
    (record,) = list_audits(addr, "stall-grpc")
    assert (record.kind, record.step, record.level) == ("stalled", 2, "warn")
    assert record.headline == told.stall_headline
    (line,) = [s for s in status_stalls(coordinator) if s["job_id"] == "stall-grpc"]
    stall = line["stall"]
    assert isinstance(stall, dict) and stall["headline"] == told.stall_headline
    with urllib.request.urlopen(f"{coordinator.metrics_url}/status", timeout=5) as page:
        assert html.escape(told.stall_headline) in page.read().decode()
    assert metric_total(coordinator.metrics_url, 'cohortgate_stalls_total{level="warn"}') == 1
    assert metric_total(coordinator.metrics_url, "cohortgate_stalled_cohorts") == 1
    # cohortgate explain: the verdict, then the stall (going on), and in JSON
    explained = cli("explain", "stall-grpc", "--addr", addr)
    assert "the stall (still going on): " + told.stall_headline in explained, explained
    as_json = json.loads(cli("explain", "stall-grpc", "--addr", addr, "--json"))
    assert [(s["kind"], s["step"]) for s in as_json["stalls"]] == [("stalled", 2)], as_json
    # a step: the stall is over, recorded with its duration
    (answer,) = send(addr, mark(v, 0, 3)).answers
    assert answer.stall_id == 0
    kinds = [r.kind for r in list_audits(addr, "stall-grpc")]
    assert kinds == ["stalled", "resumed"]
    assert metric_total(coordinator.metrics_url, "cohortgate_stalled_cohorts") == 0


def test_an_audit_marks_its_step_too(coordinator: InProcessCoordinator) -> None:
    from tests.helpers import rank_audit

    addr = coordinator.addr
    v = formed(addr, "stall-audit")
    send(addr, *(rank_audit(v, r, 4) for r in range(4)))
    (line,) = [s for s in status_stalls(coordinator) if s["job_id"] == "stall-audit"]
    assert line["step"] == 4


@pytest.mark.parametrize(
    ("fields", "code", "words"),
    [
        (
            {"digest": b"\0" * 32, "digest_format": 2},
            grpc.StatusCode.INVALID_ARGUMENT,
            "carries no digest",
        ),
        ({"step_age_s": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, "step_age_s nan"),
        ({"paused_s": -1.0}, grpc.StatusCode.INVALID_ARGUMENT, "paused_s -1.0"),
        (
            {"snapshot": pb.StackSnapshot(where="x", frames=["f"] * 33)},
            grpc.StatusCode.INVALID_ARGUMENT,
            "33 frames; the limit is 32",
        ),
        ({"snapshot": pb.StackSnapshot(where="")}, grpc.StatusCode.INVALID_ARGUMENT, "where"),
        (
            {"snapshot": pb.StackSnapshot(where="x", call="\x00")},
            grpc.StatusCode.INVALID_ARGUMENT,
            "non-printable",
        ),
        ({"paused": "p" * 600}, grpc.StatusCode.INVALID_ARGUMENT, "paused is 600 characters"),
    ],
)
def test_hostile_step_marks_get_a_clear_error_and_touch_nothing(
    coordinator: InProcessCoordinator, fields: dict[str, object], code: grpc.StatusCode, words: str
) -> None:
    addr = coordinator.addr
    v = formed(addr, "stall-bad")
    got_code, details = refused(addr, mark(v, 0, 1, **fields))
    assert got_code is code and words in details, details
    assert [s for s in status_stalls(coordinator) if s["job_id"] == "stall-bad"] == []
    (answer,) = send(addr, mark(v, 0, 1)).answers  # the server still serves
    assert answer.cohort_id == v.cohort_id


def test_a_mark_of_another_launch_of_the_job_is_refused(coordinator: InProcessCoordinator) -> None:
    addr = coordinator.addr
    v = formed(addr, "stall-other")
    other = pb.Verdict()
    other.CopyFrom(v)
    other.cohort_id = f"{v.job_id}/{v.round}/0000ffff"
    code, details = refused(addr, mark(other, 0, 1))
    assert code is grpc.StatusCode.FAILED_PRECONDITION and "another launch" in details


def test_a_step_marks_answer_carries_what_an_audits_answer_says(
    coordinator: InProcessCoordinator,
) -> None:
    """A rank's marks and audits share one answer: a mark answered while per-tensor digests
    are asked for asks for them too (an empty answer made a closing rank think the
    comparison was over, and a strict divergence found as the job ended was never raised)."""
    from tests.helpers import rank_audit

    addr = coordinator.addr
    v = formed(addr, "stall-shared", world=2)
    send(addr, rank_audit(v, 0, 0))
    (audited,) = send(addr, rank_audit(v, 1, 0, odd=True)).answers
    assert list(audited.tensors_rank) == [0, 1]
    (marked,) = send(addr, mark(v, 0, 1)).answers
    assert (list(marked.tensors_rank), marked.compared_until, marked.level) == ([0, 1], 1, "warn")


def test_a_straggler_is_named_on_the_status_page_and_counted(
    coordinator: InProcessCoordinator,
) -> None:
    """Ranks 0-2 take 0.2 s a step, rank 3 0.5 s (the marks' ages date the steps: each rank
    sends 20 marks at once, as if over the last seconds)."""
    addr = coordinator.addr
    v = formed(addr, "stall-slow")
    for rank, step_s in ((0, 0.2), (1, 0.2), (2, 0.2), (3, 0.5)):
        for step in range(20):
            send(addr, mark(v, rank, step, step_age_s=(19 - step) * step_s))
    wait = time.monotonic() + 10
    while metric_total(coordinator.metrics_url, "cohortgate_stragglers") != 1:
        assert time.monotonic() < wait, "no straggler counted"
        time.sleep(0.2)
    (line,) = [s for s in status_stalls(coordinator) if s["job_id"] == "stall-slow"]
    # (the calls' own milliseconds add to the ages' spacing: 0.502 s, 0.203 s)
    named = line["stragglers"]
    assert isinstance(named, list) and len(named) == 1, named
    said = str(named[0])
    assert re.fullmatch(
        r"rank 3 on host1: 0\.5\d* s a step, 2\.\dx its cohort's median 0\.2\d* s", said
    )
    with urllib.request.urlopen(f"{coordinator.metrics_url}/status", timeout=5) as page:
        assert f"stragglers: {html.escape(said)}" in page.read().decode()
