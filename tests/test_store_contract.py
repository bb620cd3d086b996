"""What a verdict backend must do, run against every one.

- `VerdictStore` (the part a replicated backend, such as etcd for active/standby
  coordinators, implements): a verdict is stored before it is sent, replayed to a rank
  that re-joins with its incarnation, and rounds keep counting after a restart; audit
  findings are kept per job, oldest first, and outlive a restart.
- `CohortData` and the service's rules over it: tests/test_cohort_contract.py.

A new verdict backend adds one entry to VERDICT_BACKENDS (a factory over the test's own
backing: a file, a key prefix) and must pass everything here unchanged.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cohortgate.coordinator.decision.verdict import AuditFinding, Cause, Outcome, Verdict
from cohortgate.coordinator.etcd.client import EtcdSettings, EtcdThread
from cohortgate.coordinator.service.cohorts import Cohorts
from cohortgate.coordinator.state.base import (
    JoinIntent,
    VerdictRow,
    VerdictStore,
)
from cohortgate.coordinator.state.etcd_history import EtcdHistory
from cohortgate.coordinator.state.history import History
from cohortgate.coordinator.state.memory_history import Kept, MemoryHistory
from tests.contract import WIDE, Clock, M, member, ref
from tests.etcd import EtcdServer
from tests.etcd import prefix as etcd_prefix
from tests.helpers import decide_in

pytestmark = pytest.mark.timeout(60)


# -- backends ------------------------------------------------------------------------------
# A verdict backend: given the test's directory, a function that opens the store on the same
# backing each time it is called (a second call: the store after a restart).
VerdictOpener = Callable[[], VerdictStore]


def _etcd_opener(tmp: Path, request: pytest.FixtureRequest) -> VerdictOpener:
    """An EtcdHistory on the session's etcd, under a prefix of the test's own, writing as
    the leader (a leader key this test created, its create revision the fencing token)."""
    server: EtcdServer = request.getfixturevalue("etcd")
    settings = EtcdSettings(server.endpoint, prefix=etcd_prefix())
    threads: list[EtcdThread] = []

    def close() -> None:
        for t in threads:
            t.close()

    request.addfinalizer(close)

    def opener() -> VerdictStore:
        thread = EtcdThread(settings)
        threads.append(thread)
        key = settings.key_prefix + b"leader"

        async def lead() -> int:
            await thread.client.put(key, b"{}")
            return int((await thread.client.range(key)).kvs[0].create_revision)

        token = thread.run(lead(), timeout=5)
        return EtcdHistory(thread, token=lambda: token)

    return opener


def _memory_opener(tmp: Path, request: pytest.FixtureRequest) -> VerdictOpener:
    """A MemoryHistory (--history off) over what the test's process keeps: a second one
    is the store reopened (the same process), as a file outlives a History."""
    kept = Kept()
    return lambda: MemoryHistory(kept=kept)


VERDICT_BACKENDS: dict[str, Callable[[Path, pytest.FixtureRequest], VerdictOpener]] = {
    "sqlite": lambda tmp, _: functools.partial(History, tmp / "history.sqlite"),
    "etcd": _etcd_opener,
    "memory": _memory_opener,
}
# A cohort backend: given a clock and the verdict store's last round, a store.


@pytest.fixture(params=sorted(VERDICT_BACKENDS))
def open_verdicts(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[VerdictOpener]:
    opened: list[VerdictStore] = []
    open_one = VERDICT_BACKENDS[request.param](tmp_path, request)

    def opener() -> VerdictStore:
        store = open_one()
        opened.append(store)
        return store

    yield opener
    for store in opened:
        store.close()


def verdict_of(job: str, round_: int, outcome: Outcome = Outcome.FORMED) -> Verdict:
    return Verdict(
        outcome=outcome,
        job_id=job,
        round=round_,
        cohort_id=f"{job}/{round_}/{uuid.uuid4().hex[:8]}",
        world_size=2,
        reason="[2/2 ranks joined, 1 signature]",
        decided_at=time.time() - 10 + round_,
        cause=None if outcome is Outcome.FORMED else Cause.SIGNATURE_MISMATCH,
        report="" if outcome is Outcome.FORMED else "the report\nspans lines",
        headline="" if outcome is Outcome.FORMED else "rank 1 built a different model",
    )


def record(store: VerdictStore, verdict: Verdict, members: dict[int, str]) -> None:
    """Record and wait for `written`: what the service waits for before sending."""
    stored = threading.Event()
    store.record(VerdictRow.of(verdict, members), stored.set)
    assert stored.wait(10), f"the store never said it stored the verdict ({store.problem})"


# -- VerdictStore ----------------------------------------------------------------------------
def test_a_verdict_is_stored_before_it_is_sent_and_read_back_whole(
    open_verdicts: VerdictOpener,
) -> None:
    store = open_verdicts()
    sent = verdict_of("j", 1, Outcome.REFUSED)
    record(store, sent, {0: "a", 1: "b"})
    row = store.get("j", 1)
    assert row is not None and (row.outcome, row.cause) == ("refused", "signature_mismatch")
    assert row.report == sent.report and row.members == {0: "a", 1: "b"}
    assert store.verdict_of("j", "b") == sent, "replayed exactly as the ranks received it"
    assert store.problem == "" and store.spooled == 0


def test_a_rejoining_incarnation_gets_its_own_rounds_verdict_and_nobody_elses(
    open_verdicts: VerdictOpener,
) -> None:
    store = open_verdicts()
    first, second = verdict_of("j", 1, Outcome.REFUSED), verdict_of("j", 2)
    record(store, first, {0: "a1", 1: "b1"})
    record(store, second, {0: "a2", 1: "b2"})
    assert store.verdict_of("j", "a1") == first
    assert store.verdict_of("j", "b2") == second
    assert store.verdict_of("j", "stranger") is None
    assert store.verdict_of("other-job", "a1") is None
    for round_ in range(3, 8):  # only recent rounds replay
        record(store, verdict_of("j", round_), {0: f"a{round_}"})
    assert store.verdict_of("j", "a1", rounds=4) is None


def test_rounds_keep_counting_after_a_restart(open_verdicts: VerdictOpener) -> None:
    store = open_verdicts()
    assert store.last_round("j") == 0
    for round_ in (1, 2, 3):
        record(store, verdict_of("j", round_), {0: f"i{round_}"})
    record(store, verdict_of("k", 1), {0: "k1"})
    store.close()
    again = open_verdicts()  # the coordinator restarted
    assert again.last_round("j") == 3 and again.last_round("k") == 1
    assert again.verdict_of("j", "i3") is not None, "a rank re-joining after the restart"
    assert [r.round for r in again.recent(10, "j")] == [3, 2, 1], "newest first"
    assert again.get("j") is not None and again.get("j").round == 3  # type: ignore[union-attr]


def test_a_verdict_past_the_retention_is_gone_once_the_store_reopens(
    open_verdicts: VerdictOpener,
) -> None:
    """The bound on what a store keeps: verdicts decided longer ago than the retention (30
    days by default) are deleted when a writing store opens (SQLite's writer; etcd's leader,
    which also does it hourly), not kept forever."""
    store = open_verdicts()
    old = verdict_of("j", 1)
    old = Verdict(**{**old.__dict__, "decided_at": time.time() - 31 * 86400})
    record(store, old, {0: "a1"})
    record(store, verdict_of("j", 2), {0: "a2"})
    store.close()
    again = open_verdicts()
    assert [r.round for r in again.recent(10, "j")] == [2], "round 1 is past the retention"
    assert again.verdict_of("j", "a1") is None and again.verdict_of("j", "a2") is not None


def finding(job: str, step: int, at: float, kind: str = "diverged") -> AuditFinding:
    return AuditFinding(
        job, f"{job}/1/abcd", step, kind, "strict", f"h{step}", f"report {step}", at, step + 9
    )


def test_audit_findings_are_kept_per_job_oldest_first_and_outlive_a_restart(
    open_verdicts: VerdictOpener,
) -> None:
    """What a restarted coordinator (or a new leader) re-establishes a cohort's audits
    from: every field as recorded, one job's only, the newest `limit`; past the retention
    they are gone like verdicts."""
    store = open_verdicts()
    now = time.time()
    written = [finding("j", s, now - 10 + s) for s in range(5)]
    for f in [finding("j", 0, now - 31 * 86400), *reversed(written), finding("k", 7, now)]:
        store.record_audit(f)
    assert store.flush(5.0)
    store.close()
    again = open_verdicts()
    assert again.audits("j") == written, "every field, oldest first, none past the retention"
    assert again.audits("j", limit=2) == written[-2:]
    assert [f.step for f in again.audits("k")] == [7]
    assert again.audits("nobody") == []


def test_an_audit_finding_is_read_back_at_once_before_the_writer_files_it(
    open_verdicts: VerdictOpener,
) -> None:
    """The ranks are told of a divergence when it is found; `cohortgate explain` or
    ListAudits right after must show it, whether or not the writer has filed it yet (once:
    not twice when it is filed while being read)."""
    store = open_verdicts()
    now = time.time()
    written = [finding("j", s, now + s) for s in range(3)]
    for f in written:
        store.record_audit(f)
        assert store.audits("j")[-1] == f  # no flush in between
    assert store.audits("j") == written
    assert store.flush(5.0)
    assert store.audits("j") == written
    store.close()


def test_what_the_service_records_replays_through_a_new_coordinator(
    open_verdicts: VerdictOpener, clock: Clock
) -> None:
    """End to end over the two interfaces: a memory store decides, the verdict store keeps
    it; after a restart, the verdict store replays it and numbers the next round after it."""
    history = open_verdicts()
    live = Cohorts(clock, history.last_round)
    a, b = member(0), member(1, WIDE)
    for m in (a, b):
        live.join(JoinIntent("j", 0, m, 2))
    cohort = live.find("j")
    assert cohort is not None
    for m, manifest in ((a, M), (b, WIDE)):
        live.upload(ref(cohort, m), manifest, m.signature)
    decide_in(live, cohort, clock())
    verdict = cohort.verdict
    assert verdict is not None and verdict.outcome is Outcome.REFUSED
    record(history, verdict, {m.rank: m.incarnation for m in (a, b)})
    history.close()
    restarted = open_verdicts()
    replayed = restarted.verdict_of("j", b.incarnation)
    assert replayed is not None and replayed.report == verdict.report
    assert replayed.diffs == verdict.diffs and replayed.classes == verdict.classes
    fresh = Cohorts(clock, restarted.last_round)
    assert fresh.join(JoinIntent("j", 0, member(0), 2)).cohort.round == 2
