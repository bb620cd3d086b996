"""The agent's sender (agent/audit.py's Auditor) against a real coordinator, without torchrun:
the audits it sends and the answers it heeds, the step marks it sends, the snapshot it
answers a stall with, and the end a strict stall makes (in a process of its own: it ends the
process). The torchrun paths are test_e2e_audits.py and test_e2e_stalls.py; these run in
the fast tier and under `make mutation`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cohortgate.agent.audit import Auditor
from cohortgate.agent.torchrun import CohortStalled, RankIdentity, ReplicasDiverged
from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from tests.helpers import REPO, InProcessCoordinator, wait_until
from tests.test_audits_grpc import formed, list_audits

pytestmark = pytest.mark.timeout(90)


def identity(addr: str, v: pb.Verdict, rank: int, error_file: str | None = None) -> RankIdentity:
    return RankIdentity(
        job_id=v.job_id,
        rank=rank,
        world_size=v.world_size,
        local_rank=rank,
        host="here",
        pid=0,
        incarnation=f"i{rank}",
        restart_count=0,
        addr=addr,
        error_file=error_file,
        endpoint_host="127.0.0.1",
    )


def auditors(addr: str, v: pb.Verdict) -> list[Auditor]:
    return [Auditor(identity(addr, v, r), v.cohort_id, v.round, "") for r in range(v.world_size)]


def counted(beat: Callable[[], pb.RankAudit], counts: list[int], rank: int) -> Any:
    """`beat`, counting its calls in counts[rank] (the marks that rank sends)."""

    def wrapped() -> pb.RankAudit:
        counts[rank] += 1
        return beat()

    return wrapped


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


@pytest.fixture
def coordinator(request: pytest.FixtureRequest) -> Iterator[InProcessCoordinator]:
    flags: dict[str, object] = getattr(request, "param", {})
    c = InProcessCoordinator(join_deadline=20, audit_timeout=5.0, stall_after="2", **flags)
    try:
        yield c
    finally:
        c.stop()


def test_replicas_that_agree_close_quietly_and_every_step_is_compared(
    coordinator: InProcessCoordinator,
) -> None:
    v = formed(coordinator.addr, "agent-clean", world=2)
    ranks = auditors(coordinator.addr, v)
    m = model()
    for step in range(3):
        for a in ranks:
            a.audit(m, step)
    for a in ranks:
        a.close(10)
        assert a.compared_until == 3 and not a.headline
    assert list_audits(coordinator.addr, "agent-clean") == []


@pytest.mark.parametrize("coordinator", [{"policy": "audit=strict"}], indirect=True)
def test_a_divergence_found_as_the_job_ends_is_raised_at_close_under_strict(
    coordinator: InProcessCoordinator,
) -> None:
    v = formed(coordinator.addr, "agent-strict", world=2)
    a0, a1 = auditors(coordinator.addr, v)
    a0.audit(model(0), 0)
    a1.audit(model(1), 0)  # other weights: rank 1 differs
    with pytest.raises(ReplicasDiverged) as raised:
        a1.close(10)
    assert raised.value.step == 0
    assert raised.value.headline == (
        "replicas diverged at step 0: no majority: rank 0 on here and rank 1 on here hold "
        "different weights in 0.weight"
    )
    with pytest.raises(ReplicasDiverged):
        a0.close(10)
    (record,) = list_audits(coordinator.addr, "agent-strict")
    assert (record.kind, record.step, record.level) == ("diverged", 0, "strict")


@pytest.mark.slow  # waits out --stall-after and the ranks' next marks
def test_every_nth_step_is_audited_and_none_under_the_off_policy(
    coordinator: InProcessCoordinator,
) -> None:
    """COHORTGATE_AUDIT_EVERY (Auditor.every): steps between are marked, not audited; the
    off policy audits nothing."""
    v = formed(coordinator.addr, "agent-every", world=2)
    ranks = auditors(coordinator.addr, v)
    m = model()
    for a in ranks:
        a.every = 2
        for step in range(4):
            a.audit(m, step)
        a.close(10)
        assert (a.last_step, a.compared_until) == (2, 3), "steps 0 and 2 audited, 3 not"
    off = Auditor(identity(coordinator.addr, v, 0), v.cohort_id, v.round, "")
    off.level = "off"
    off.audit(m, 4)
    assert off.last_step == -1 and not off.queue
    off.close(1)


def test_under_warn_each_rank_says_the_divergence_once_and_trains_on(
    coordinator: InProcessCoordinator, capsys: pytest.CaptureFixture[str]
) -> None:
    """The warn policy: every rank says the divergence on stderr once (the report from
    local rank 0), however many audits and closes follow; nothing is raised."""
    v = formed(coordinator.addr, "agent-warn", world=2)
    ranks = auditors(coordinator.addr, v)
    for r, a in enumerate(ranks):
        a.audit(model(r), 0)  # rank 1 differs
    wait_until("the divergence heard", lambda: all(a.headline for a in ranks), 30)
    for step in (1, 2):
        for r, a in enumerate(ranks):
            a.audit(model(r), step)
    for a in ranks:
        a.close(10)
    told = capsys.readouterr().err
    headline, report = ranks[0].headline, ranks[0].report
    assert headline.startswith("replicas diverged at step 0: ") and ranks[1].headline == headline
    assert told.count(f"[cohortgate] rank 0 on here: {headline}\n{report}\n") == 1, told
    assert told.count(f"[cohortgate] rank 1 on here: {headline}\n") == 1, told
    assert told.count(report) == 1, "the report from local rank 0 only"


def test_close_without_the_last_word_says_so_once_and_returns(
    coordinator: InProcessCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    """A rank whose peer never audits its last step: close() waits its timeout, says it
    closes without the comparison, and returns; closing again returns at once, silent."""
    v = formed(coordinator.addr, "agent-alone", world=2)
    alone = auditors(coordinator.addr, v)[0]
    alone.audit(model(), 0)
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="cohortgate.agent"):
        alone.close(1.0)
        waited = time.monotonic() - started
        alone.close(1.0)  # closed already: nothing waited for, nothing said
    assert [r.getMessage() for r in caplog.records] == [
        "cohortgate: the audit of step 0 was not compared within 1s of cohort.close() (a "
        "rank sent none, or the coordinator is unreachable); closing without its word"
    ]
    assert waited >= 1.0, "it waited its timeout for the last word"


@pytest.mark.parametrize("coordinator", [{"policy": "audit=strict"}], indirect=True)
def test_strict_stops_each_rank_at_the_stop_step_with_the_same_words_once(
    coordinator: InProcessCoordinator, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A divergence under strict: each rank's audit at the stop step raises
    ReplicasDiverged, says so on stderr (the report from local rank 0 only) and in
    torchrun's error file; closing afterwards says nothing more."""
    v = formed(coordinator.addr, "agent-stop", world=2)
    errors = [str(tmp_path / f"error-{r}.json") for r in range(2)]
    ranks = [
        Auditor(identity(coordinator.addr, v, r, errors[r]), v.cohort_id, v.round, "")
        for r in range(2)
    ]
    for r, a in enumerate(ranks):
        a.audit(model(r), 0)  # rank 1 differs
    wait_until("the stop step told", lambda: all(a.stop_step for a in ranks), 30)
    stop = ranks[0].stop_step
    assert stop > 0 and ranks[1].stop_step == stop
    for a in ranks:
        a.audit(model(0), stop - 1)  # before the stop step: training goes on
        with pytest.raises(ReplicasDiverged) as raised:
            a.audit(model(0), stop)
        assert raised.value.step == stop and raised.value.headline == a.headline
        assert raised.value.report == a.report and a.report
        a.close(10)  # raised already: not told twice
    told = capsys.readouterr().err
    headline = ranks[0].headline
    assert headline.startswith("replicas diverged at step 0: ")
    for r in range(2):
        said = f"[cohortgate] rank {r} on here: stopped at step {stop}: {headline}"
        assert told.count(said) == 1, told
        written = json.loads(Path(errors[r]).read_text())["message"]
        assert written["message"] == f"ReplicasDiverged: {headline}"
        assert written["extraInfo"]["py_callstack"] == f"{headline}\n{ranks[r].report}"
    assert told.count(ranks[0].report) == 1, "the report once, from local rank 0"
    assert f"rank 0 on here: stopped at step {stop}: {headline}\n{ranks[0].report}" in told


def test_an_optimizer_whose_state_differs_is_a_divergence(
    coordinator: InProcessCoordinator,
) -> None:
    """The optimizer's state is audited with the weights: the same weights with other
    momentum buffers diverge."""
    v = formed(coordinator.addr, "agent-optim", world=2)
    ranks = auditors(coordinator.addr, v)
    for r, a in enumerate(ranks):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.0, momentum=0.9)  # lr 0: weights stay
        m(torch.full((2, 4), float(r + 1))).sum().backward()  # other gradients per rank
        opt.step()
        a.audit(m, 0, optimizer=opt)
    for a in ranks:
        a.close(10)
    assert ranks[0].headline == (
        "replicas diverged at step 0: no majority: rank 0 on here and rank 1 on here hold "
        "different weights in optimizer.state.0.momentum_buffer"
    )
    assert "3 tensors of 8 differ: optimizer.state.0.momentum_buffer," in ranks[0].report


def test_step_marks_name_a_stall_and_each_rank_hears_it_once(
    coordinator: InProcessCoordinator, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two ranks mark steps 0-3, then none: after --stall-after 2 each is asked where its
    main thread is (this test's, waiting below), and the stall is told to each rank once."""
    v = formed(coordinator.addr, "agent-stall", world=2)
    ranks = auditors(coordinator.addr, v)
    beats = [0, 0]
    for a in ranks:
        a._beat = counted(a._beat, beats, a.identity.rank)  # type: ignore[method-assign]
    for step in range(4):
        for a in ranks:
            a.mark(step)
    wait_until("the stall told", lambda: all(a._stall_told for a in ranks), 30)
    # one snapshot per rank: each answer asks until the report is out, and a rank that
    # sent its snapshot does not send it again (it did, in a loop, as fast as answered)
    assert max(beats) < 20, f"step marks sent by ranks 0 and 1 in a few seconds: {beats}"
    (record,) = list_audits(coordinator.addr, "agent-stall")
    assert (record.kind, record.step, record.level) == ("stalled", 3, "warn")
    assert re.search(r"stalled at step 3 for \d+ s: ranks 0-1 on here in \S+ \(", record.headline)
    assert "in wait_until (" in record.headline  # the main thread's innermost user frame
    told = capsys.readouterr().err
    for rank in (0, 1):
        assert told.count(f"[cohortgate] rank {rank} on here: {record.headline}") == 1, told
    assert len(re.findall(r"last steps: ranks 0-1 at step 3 \(\d+ s ago\)", told)) == 1  # rank 0
    for a in ranks:
        a.mark(4)  # moving again: the stall is over
    wait_until(
        "the stall closed",
        lambda: (
            [r.kind for r in list_audits(coordinator.addr, "agent-stall")] == ["stalled", "resumed"]
        ),
        10,
    )
    assert all(a.stalled is None for a in ranks)  # warn: nothing raised, nothing ended


@pytest.mark.slow  # pauses past --stall-after
def test_a_pause_on_purpose_is_told_at_once_and_is_no_stall(
    coordinator: InProcessCoordinator,
) -> None:
    v = formed(coordinator.addr, "agent-pause", world=2)
    ranks = auditors(coordinator.addr, v)
    for step in range(3):
        for a in ranks:
            a.mark(step)
    with ranks[0].pause("checkpoint"):
        time.sleep(4.5)  # past --stall-after 2
    assert list_audits(coordinator.addr, "agent-pause") == []


STRICT_SCRIPT = """
import sys, time
sys.path.insert(0, {repo!r})
from cohortgate.agent.audit import Auditor
from cohortgate.agent.torchrun import CohortStalled
from tests.test_auditor import identity
from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
v = pb.Verdict.FromString(bytes.fromhex({verdict!r}))
a = Auditor(identity({addr!r}, v, {rank}, {error_file!r}), v.cohort_id, v.round, "")
for step in range(3):
    a.mark(step)

def stuck():
    time.sleep(60)

def marking():
    while True:
        a.mark(2)
        time.sleep(0.05)

try:
    {body}()
except CohortStalled as exc:
    print("raised:", exc.headline, flush=True)
    sys.exit(7)
"""


@pytest.mark.slow  # two processes that wait out --stall-after
@pytest.mark.parametrize("coordinator", [{"policy": "stall=strict"}], indirect=True)
def test_strict_ends_a_stuck_process_and_raises_in_one_that_reaches_its_next_mark(
    coordinator: InProcessCoordinator, tmp_path: Path
) -> None:
    """Rank 0's main thread is stuck in its own code: the background thread writes the
    report to the error file and ends the process (exit 6). Rank 1 keeps calling
    cohort.step(): it raises CohortStalled there (its script exits 7)."""
    v = formed(coordinator.addr, "agent-strict-stall", world=2)
    procs = []
    for rank, body in ((0, "stuck"), (1, "marking")):
        script = STRICT_SCRIPT.format(
            repo=str(REPO),
            verdict=v.SerializeToString().hex(),
            addr=coordinator.addr,
            rank=rank,
            error_file=str(tmp_path / f"error-{rank}.json"),
            body=body,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", script],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [6, 7], outs
    assert outs[1][0].startswith("raised: stalled at step 2 for "), outs[1]
    for rank in (0, 1):
        error = json.loads((tmp_path / f"error-{rank}.json").read_text())["message"]
        assert error["message"].startswith("CohortStalled: stalled at step 2 for "), error
        assert "rank 0 on here in stuck (" in error["extraInfo"]["py_callstack"], error
    assert "ending the job (--policy stall=strict)" in outs[0][1], outs[0][1]


class _EndRecorded(Auditor):
    """The sender with the end of its process recorded, not done: this test's process must
    live on (test_strict_ends_a_stuck_process_and_raises_in_one_that_reaches_its_next_mark
    ends real processes)."""

    def __init__(self, ident: RankIdentity) -> None:
        super().__init__(ident, "cohort", 1, "")
        self.ended = threading.Event()

    def _end(self) -> None:
        self.ended.set()


def test_a_stall_answer_is_said_once_per_stall_and_under_strict_ends_the_job_with_its_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The coordinator's answers as the sender hears them: a snapshot asked for once per
    stall; the stall said once per rank (the report by local rank 0 only); under strict the
    report in torchrun's error file, the end started, and the next mark raising it."""
    v = pb.Verdict(job_id="answers", world_size=2)
    ranks = [
        _EndRecorded(identity("127.0.0.1:1", v, r, str(tmp_path / f"e{r}.json"))) for r in (0, 1)
    ]
    for a in ranks:
        a._heard_stall(pb.AuditAnswer(snapshot_wanted=3))
        assert a._snapshot_for == 3
        a._snapshot_for, a._snapshot_sent = 0, 3  # the sender sent it
        a._heard_stall(pb.AuditAnswer(snapshot_wanted=3))  # asked again until the report
        assert a._snapshot_for == 0
        a._heard_stall(pb.AuditAnswer(snapshot_wanted=5))  # the next stall's
        a._heard_stall(pb.AuditAnswer())  # an answer to an earlier beat: still wanted
        assert a._snapshot_for == 5
        a._snapshot_for = 0
    warn = pb.AuditAnswer(stall_id=3, stall_headline="H3", stall_report="R3")
    for a in ranks:
        a._heard_stall(warn)
        a._heard_stall(warn)  # every answer says so until the stall is over: said once
        assert a.stalled is None and not a.ended.is_set()
    assert capsys.readouterr().err == (
        "[cohortgate] rank 0 on here: H3\nR3\n[cohortgate] rank 1 on here: H3\n"
    )
    strict = pb.AuditAnswer(stall_id=4, stall_headline="H4", stall_report="R4", stall_stop=True)
    ranks[1]._heard_stall(strict)
    assert capsys.readouterr().err == (
        "[cohortgate] rank 1 on here: H4\n"
        "[cohortgate] rank 1: ending the job (--policy stall=strict)\n"
    )
    error = json.loads((tmp_path / "e1.json").read_text())["message"]
    assert (error["message"], error["extraInfo"]["py_callstack"]) == ("CohortStalled: H4", "H4\nR4")
    assert ranks[1].ended.wait(10)
    assert ranks[1].stalled == ("H4", "R4")
    with pytest.raises(CohortStalled) as raised:
        ranks[1].mark(9)
    assert (raised.value.headline, raised.value.report) == ("H4", "R4")
    assert not (tmp_path / "e0.json").exists() and not ranks[0].ended.is_set()


RETURNS_SCRIPT = """
import sys
sys.path.insert(0, {repo!r})
from cohortgate.agent import cohort
from tests.test_auditor import _EndRecorded, identity
from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
# the stall's own end (STALL_GRACE_S after the report) never comes: the script returns first
a = _EndRecorded(identity("127.0.0.1:1", pb.Verdict(job_id="j", world_size=1), 0, None))
cohort._AUDITORS[("cohort", 0)] = a
cohort._register_close_at_exit()
a._heard_stall(pb.AuditAnswer(stall_id=1, stall_headline="H", stall_report="R", stall_stop=True))
"""


def test_a_script_that_returns_after_a_strict_stall_still_exits_with_the_stall_code() -> None:
    """Its rank said it ends the job: the exit hook ends it with EXIT_STALLED, never 0."""
    from cohortgate.agent.audit import EXIT_STALLED

    done = subprocess.run(
        [sys.executable, "-c", RETURNS_SCRIPT.format(repo=str(REPO))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == EXIT_STALLED, done.stderr
    assert "ending the job (--policy stall=strict)" in done.stderr
