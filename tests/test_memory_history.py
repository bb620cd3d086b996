"""The verdict history of `serve --history off` (state/memory_history.py): the contract
suite runs over it (tests/test_store_contract.py); here, what only a store in memory needs:
a bound, oldest verdicts out first, and a coordinator that keeps verdicts without a file."""

from __future__ import annotations

import pytest

from cohortgate.coordinator.decision.verdict import AuditFinding
from cohortgate.coordinator.state.base import VerdictRow
from cohortgate.coordinator.state.memory_history import MAX_FINDINGS, MemoryHistory
from tests.test_store_contract import verdict_of

pytestmark = pytest.mark.timeout(30)


def test_the_oldest_verdicts_go_first_past_the_bound_of_verdicts_or_members() -> None:
    history = MemoryHistory(max_verdicts=3)
    for round_ in range(1, 6):
        history.record(VerdictRow.of(verdict_of("j", round_), {0: f"a{round_}"}))
    assert [r.round for r in history.recent(10, "j")] == [5, 4, 3]
    assert history.verdict_of("j", "a2") is None and history.verdict_of("j", "a3") is not None
    assert history.last_round("j") == 5 and history.get("j", 2) is None
    # Members count too: one job of 1,000 ranks pushes the small ones out.
    wide = MemoryHistory(max_member_chars=33_020)
    wide.record(VerdictRow.of(verdict_of("small", 1), {0: "s" * 32}))
    wide.record(VerdictRow.of(verdict_of("big", 1), {r: f"{r:032x}" for r in range(1000)}))
    assert wide.get("small") is None and wide.last_round("small") == 0
    got = wide.get("big")
    assert got is not None and len(got.members) == 1000 and got.members[999] == f"{999:032x}"


def test_a_verdict_recorded_again_replaces_its_row_and_written_is_called_at_once() -> None:
    history = MemoryHistory()
    calls: list[int] = []
    history.record(VerdictRow.of(verdict_of("j", 1), {0: "a"}), lambda: calls.append(1))
    assert calls == [1], "stored on the caller's thread: written at once"
    again = verdict_of("j", 1)
    history.record(VerdictRow.of(again, {0: "b"}))
    assert history.verdict_of("j", "b") == again and history.verdict_of("j", "a") is None
    assert [r.round for r in history.recent(10)] == [1]
    assert history.kept.member_chars == len("0\nb")


def test_findings_are_capped_per_job_keeping_the_newest() -> None:
    history = MemoryHistory()
    for step in range(MAX_FINDINGS + 5):
        history.record_audit(
            AuditFinding("j", "j/1/x", step, "diverged", "warn", "h", "r", 1e9 + step, step)
        )
    kept = history.audits("j", limit=MAX_FINDINGS + 10)
    assert len(kept) == MAX_FINDINGS and kept[0].step == 5 and kept[-1].step == MAX_FINDINGS + 4


def test_serve_with_history_off_replays_lists_and_numbers_rounds_from_memory() -> None:
    """`--history off`: a job evicted from the live store (--job-retention) is still in the
    verdict history in memory: a rank re-joining with its incarnation gets its verdict back,
    GetVerdict answers, and the job's next launch is round 2, not round 1 again."""
    from concurrent.futures import ThreadPoolExecutor

    from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
    from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
    from cohortgate.coordinator.codec.channel import ClientSecurity
    from tests.helpers import InProcessCoordinator, join_request, manifest_of, run_rank

    c = InProcessCoordinator(history="off", join_deadline=20.0)
    try:
        m = manifest_of()
        requests = [join_request("off", r, 2, m) for r in range(2)]
        with ThreadPoolExecutor(2) as pool:
            first = list(pool.map(lambda req: run_rank(c.addr, req, m), requests))
        verdict = first[1].verdict
        assert verdict is not None and verdict.outcome == pb.Verdict.OUTCOME_FORMED
        assert c.call(lambda: c.running.coordinator.store.evict(-1.0)) == 1
        assert c.call(lambda: c.running.coordinator.find("off")) is None
        again = run_rank(c.addr, requests[1], m, timeout=10)
        assert again.verdict is not None and again.verdict.cohort_id == verdict.cohort_id
        with ClientSecurity().channel(c.addr) as channel:
            record = pb_grpc.StatusServiceStub(channel).GetVerdict(
                pb.GetVerdictRequest(job_id="off"), timeout=5
            )
        assert (record.round, record.outcome) == (1, "formed")
        fresh = join_request("off", 0, 2, m)
        with ClientSecurity().channel(c.addr) as channel:
            stream = pb_grpc.CohortServiceStub(channel).Join(fresh, timeout=10)
            progress = next(e for e in stream if e.WhichOneof("event") == "progress")
            stream.cancel()
        assert progress.progress.round == 2
    finally:
        c.stop()


def test_a_verdict_stored_at_once_goes_out_at_once_without_the_record_timer() -> None:
    """Record, then send: a history that stores before `record` returns (this one) has the
    verdict delivered there and then, not on a later turn of the loop behind a timer."""
    import asyncio

    from cohortgate.coordinator.decision.verdict import Outcome, Verdict
    from cohortgate.coordinator.service.core import Coordinator
    from cohortgate.coordinator.service.events import UploadAsk
    from cohortgate.coordinator.state.base import JoinIntent
    from tests.helpers import manifest_of, member_of

    async def one_rank() -> tuple[bool, bool, object]:
        coordinator = Coordinator()
        m = manifest_of()
        events = coordinator.join_group([JoinIntent("now", 0, member_of(0, m), 1)])
        ask = await anext(events)
        assert isinstance(ask, UploadAsk)
        coordinator.upload(ask.ref, m, m.signature())  # completes the cohort: decided
        cohort = coordinator.find("now")
        assert cohort is not None and cohort.verdict is not None
        recording = coordinator.delivery.recording(cohort)
        tracked = coordinator.book.get(cohort) is not None
        verdict = await anext(events)
        coordinator.close()
        return recording, tracked, verdict

    recording, tracked, verdict = asyncio.run(one_rank())
    assert (recording, tracked) == (False, False), "delivered as the upload decided it"
    assert isinstance(verdict, Verdict) and verdict.outcome is Outcome.FORMED
