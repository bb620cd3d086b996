"""What a new user tripped on, following the README on a fresh clone: each fixed and kept so."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.report import judge
from cohortgate.coordinator.edge.config import run_history
from cohortgate.coordinator.service.cohorts import Cohorts
from cohortgate.coordinator.state.base import JoinIntent
from tests.helpers import (
    REPO,
    InProcessCoordinator,
    free_port,
    join_request,
    manifest_of,
    member_of,
    run_cohort,
)
from tests.launches import TRAIN, finish, kill_group, launch, launch_env
from tests.test_relay_faults import relay_process

CLI = [sys.executable, "-m", "cohortgate.coordinator.cli"]


def cli(*args: str, timeout: float = 30, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **env},
        check=False,
    )


# -- a 2-2 split names no culprit -------------------------------------------------------
def _split_headline(sizes: tuple[int, int]) -> str:
    store = Cohorts(time.time)
    narrow, wide = manifest_of(4), manifest_of(8)
    world = sum(sizes)
    for rank in range(world):
        m = narrow if rank < sizes[0] else wide
        member = member_of(rank, m, host=f"node{'ab'[rank >= sizes[0]]}")
        result = store.join(JoinIntent("split", 0, member, world))
        result.cohort.state.manifests[m.signature()] = m
    cohort = store.find("split")
    assert cohort is not None
    _, verdict = judge(cohort.state, time.time(), FormationOptions())
    assert verdict is not None
    return verdict.headline


def test_a_tie_between_two_models_names_both_sides_and_no_culprit() -> None:
    headline = _split_headline((2, 2))
    assert headline.startswith("no majority: ranks 0-1 on nodea and ranks 2-3 on nodeb built ")
    assert "compare them" in headline
    majority = _split_headline((3, 1))
    assert majority.startswith("rank 3 on nodeb built a different model than ranks 0-2")


# -- a node going down abandons one round, not one per rank ------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_ranks_of_a_relayed_node_dying_together_abandon_one_round(tmp_path: Path) -> None:
    c = InProcessCoordinator(join_deadline=60.0)
    m = manifest_of()
    try:
        with relay_process(c.addr, tmp_path, "--local-ranks", "4") as (relay, _):
            channels = [grpc.insecure_channel(relay) for _ in range(4)]
            calls = [
                pb_grpc.CohortServiceStub(ch).Join(join_request("ctrl-c", r, 8, m), timeout=60)
                for r, ch in enumerate(channels)
            ]
            give_up = time.monotonic() + 20
            while not _joined(c, "ctrl-c", 4):
                assert time.monotonic() < give_up, "the node's ranks never reached it"
                time.sleep(0.05)
            for call in calls:  # Ctrl-C: torchrun's workers die one after another
                call.cancel()
                time.sleep(0.03)
            time.sleep(1.5)
            rows = c.call(lambda: c.running.coordinator.summaries("ctrl-c"))
            for ch in channels:
                ch.close()
    finally:
        c.stop()
    assert [r.state for r in rows] == ["abandoned"], rows
    assert rows[0].missing_ranks == "" and rows[0].reason.startswith("every rank left")


def _joined(c: InProcessCoordinator, job: str, n: int) -> bool:
    def look() -> bool:
        cohort = c.running.coordinator.find(job)
        return cohort is not None and len(cohort.state.members) == n

    return bool(c.call(look))


# -- unknown jobs: say so, and name the ids torchrun generated --------------------------
def test_status_explain_and_watch_of_an_unknown_job_say_why(
    coord: InProcessCoordinator,
) -> None:
    generated = str(uuid.uuid4())
    run_cohort(coord.addr, generated, {0: manifest_of()})
    status = cli("status", "job-42", "--addr", coord.addr)
    assert status.returncode == 0 and "no cohorts for job job-42" in status.stdout
    assert f"recent jobs with generated ids: {generated}" in status.stderr
    assert "COHORTGATE_JOB=job-42" in status.stderr
    explain = cli("explain", "job-42", "--addr", coord.addr)
    assert explain.returncode == 1 and f"generated ids: {generated}" in explain.stderr
    watch = subprocess.Popen(
        [*CLI, "watch", "job-42", "--addr", coord.addr],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert watch.stderr is not None
        first = watch.stderr.readline()
        second = watch.stderr.readline()
    finally:
        kill_group(watch)
    assert first.startswith(f"no cohort of job job-42 on {coord.addr} yet: waiting for its")
    assert generated in second


# -- cohortgate run --------------------------------------------------------------------
def test_run_without_torch_says_which_extra_to_install() -> None:
    script = (
        "import sys; sys.modules['torch'] = None;"
        "from cohortgate.coordinator.cli.main import main;"
        f"sys.exit(main(['run', '--nproc-per-node', '1', {str(TRAIN)!r}]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 2
    assert "pip install 'cohortgate[agent]'" in run.stderr
    assert "[cohortgate] job" not in run.stdout, "nothing started"


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_a_run_keeps_its_own_history_and_explain_finds_it_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cohortgate run`'s private coordinator writes its own history file, not the shared
    one (whose status would list it), and `cohortgate explain` still finds the job."""
    home = tmp_path / "home"
    runs = home / ".local/state/cohortgate/runs"
    runs.mkdir(parents=True)
    stale, recent = runs / "stale-0123abcd.sqlite", runs / "recent-4567ef01.sqlite"
    for f in (stale, recent, Path(f"{stale}-wal")):
        f.write_bytes(b"")
    month_ago = time.time() - 31 * 86400  # past the default 30 days' retention
    os.utime(stale, (month_ago, month_ago))
    job = f"own-history-{uuid.uuid4().hex[:6]}"
    env = launch_env(tmp_path, HOME=str(home), COHORTGATE_JOB=job)
    env.pop("COHORTGATE_HISTORY", None)
    proc = launch(
        ["--nproc-per-node", "2", str(TRAIN), "--steps", "1"], env, tmp_path, via="cohortgate run"
    )
    (out,) = finish([proc], timeout=200)
    assert proc.returncode == 0, out
    assert f"[cohortgate] job {job}, coordinator 127.0.0.1:" in out and "(started here)" in out
    shared = home / ".local/state/cohortgate/history.sqlite"
    monkeypatch.setenv("HOME", str(home))
    own = run_history(job)
    assert own.is_file() and not shared.exists()
    nobody = f"127.0.0.1:{free_port()}"
    explain = cli("explain", job, "--addr", nobody, HOME=str(home))
    assert explain.returncode == 0, explain.stderr
    assert f"job {job} round 1: formed" in explain.stdout
    # A run's history lives past the run, the retention prunes the old ones, and reading a
    # history leaves no -wal/-shm beside it: nothing else is left in the home directory.
    left = sorted(str(f.relative_to(home)) for f in home.rglob("*") if f.is_file())
    assert left == [str(p.relative_to(home)) for p in sorted((own, recent))], left
    # The demo keeps its jobs in one file of the runs (examples/demo.py: runs/demo.sqlite):
    # explain finds a job in whichever run history holds it.
    own.rename(runs / "demo.sqlite")
    explain = cli("explain", job, "--addr", nobody, HOME=str(home))
    assert explain.returncode == 0 and f"job {job} round 1: formed" in explain.stdout


# -- examples, the demo, the install ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_example_names_an_unreachable_coordinator_in_one_line(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "COHORTGATE_ADDR": f"127.0.0.1:{free_port()}",
        "COHORTGATE_TIMEOUT": "2",
        "COHORTGATE_JOB": "unreachable",
        "PYTHONPATH": str(REPO),
    }
    run = subprocess.run(
        [sys.executable, str(TRAIN), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        check=False,
    )
    assert run.returncode == 4, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("rank 0: cohortgate:")]
    assert env["COHORTGATE_ADDR"] in line


def test_the_demo_prints_the_command_it_runs() -> None:
    spec = importlib.util.spec_from_file_location("demo", REPO / "examples" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", "0", str(TRAIN), "--wide-rank", "2"]
    shown = shlex.split(demo.shown_command("127.0.0.1:7070", "demo-x", cmd).removeprefix("$ "))
    env = dict(w.split("=", 1) for w in shown[:3])
    assert env == {
        "COHORTGATE_ADDR": "127.0.0.1:7070",
        "COHORTGATE_JOB": "demo-x",
        "OMP_NUM_THREADS": "1",
    }
    assert shown[3] == "torchrun"
    assert [str(Path(w).resolve()) if w.endswith(".py") else w for w in shown[4:]] == cmd[3:]


def test_the_install_enables_no_service() -> None:
    """Debian's prometheus package enables prometheus.service: it is unpacked, never
    installed; chromium (which starts nothing) is installed."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile[makefile.index("system-deps: venv") : makefile.index("## test:")]
    installs = re.findall(r"apt-get install[^;]*", recipe.replace("\\\n", " "))
    assert installs and all("prometheus" not in i for i in installs), installs
    assert "dpkg-deb -x" in recipe and "apt-get download -q prometheus" in recipe
