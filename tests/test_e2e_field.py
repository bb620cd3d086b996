"""End to end, the way users deploy: two `cohortgate run --nnodes 2` launches on one machine
are two nodes; SIGTERM to `cohortgate run`; two launches that reuse one job id."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import free_port
from tests.launches import (
    TRAIN,
    coordinator_process,
    finish,
    kill_group,
    launch,
    launch_env,
    two_node_args,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_two_nodes_through_cohortgate_run_form_then_a_wider_node_is_refused_on_both(
    tmp_path: Path,
) -> None:
    with coordinator_process("--join-deadline", "120", tmp=tmp_path) as (addr, _):
        outputs = {}
        for job, extra in (("two-nodes", []), ("two-nodes-wide", ["--wide-node", "1"])):
            rdzv = f"127.0.0.1:{free_port()}"
            args = [
                "--coordinator",
                addr,
                *two_node_args(rdzv, job, TRAIN, "--steps", "2", *extra),
            ]
            envs = [launch_env(tmp_path), launch_env(tmp_path)]
            procs = [launch(args, env, tmp_path, via="cohortgate run") for env in envs]
            outputs[job] = (procs, finish(procs))
            for env in envs:
                assert not list(Path(env["TMPDIR"]).glob("cohortgate-*"))
    procs, outs = outputs["two-nodes"]
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out
        assert "[cohortgate] job two-nodes, coordinator 127.0.0.1:" in out, out
        assert "through this node's relay 127.0.0.1:" in out, out
        assert out.count("formed, all_reduce sum 10, trained 2 steps") == 2, out
    procs, outs = outputs["two-nodes-wide"]
    reports = []
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode != 0, out
        # Two nodes of two ranks: a tie, so neither node is named the culprit.
        assert "no majority: ranks 0-1 on" in out and "and ranks 2-3 on" in out, out
        start = out.index("cohortgate refused to form job 'two-nodes-wide' round 1")
        reports.append(out[start : out.index("What to do", start)])
    assert reports[0] == reports[1], "both nodes get the same report"
    assert "differs:   signature" in reports[0] and "2 ranks [2-3]" in reports[0]


def test_a_torchrun_restart_through_cohortgate_run_on_two_nodes_forms_the_next_round(
    tmp_path: Path,
) -> None:
    """Rank 3 (node 2) dies right after its cohort formed; torchrun (--max-restarts 1)
    restarts every worker on both nodes, and through the node relays the restarted workers
    form round 2 and train."""
    with coordinator_process("--join-deadline", "120", tmp=tmp_path) as (addr, log):
        rdzv = f"127.0.0.1:{free_port()}"
        job = "restart-relay"
        two = two_node_args(rdzv, job, TRAIN, "--steps", "2", "--crash-rank", "3")
        args = ["--coordinator", addr, "--max-restarts", "1", *two]
        procs = [launch(args, launch_env(tmp_path), tmp_path, via="cohortgate run") for _ in "ab"]
        outs = finish(procs)
        said = log.read_text()
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, f"{out}\n--- the other node:\n{''.join(outs)}\n{said}"
        assert "through this node's relay 127.0.0.1:" in out, out
    both = "".join(outs)
    assert f"rank 3: crashing after cohort {job}/1/" in both, both
    trained = re.findall(
        rf"cohort ({job}/\d+/\w+) formed, all_reduce sum 10, trained 2 steps", both
    )
    assert len(trained) == 4 and {c.split("/")[1] for c in trained} == {"2"}, both


def _marked(mark: str) -> list[int]:
    """Pids of processes whose environment carries the test's marker."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if mark.encode() in (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_cohortgate_run_ends_the_whole_tree_and_cleans_up(
    tmp_path: Path, sig: signal.Signals
) -> None:
    mark = f"COHORTGATE_TEST_MARK={uuid.uuid4().hex}"
    env = launch_env(tmp_path, COHORTGATE_TEST_MARK=mark.split("=")[1])
    env["COHORTGATE_HISTORY"] = "off"
    proc = launch(
        ["--nproc-per-node", "2", "--master-port", "0", str(TRAIN), "--absent-rank", "1"],
        env,
        tmp_path,
        via="cohortgate run",
    )
    try:
        give_up = time.monotonic() + 90
        # the coordinator, torchrun and both workers are up, rank 0 waiting for rank 1
        while (
            len(
                [p for p in _marked(mark) if b"train.py" in Path(f"/proc/{p}/cmdline").read_bytes()]
            )
            < 3
        ):
            assert proc.poll() is None and time.monotonic() < give_up
            time.sleep(0.2)
        time.sleep(2)
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=60)
    finally:
        kill_group(proc)
    assert code == 128 + sig, code
    give_up = time.monotonic() + 10
    while _marked(mark) and time.monotonic() < give_up:
        time.sleep(0.2)
    assert _marked(mark) == [], "processes outlived cohortgate run"
    assert not list(Path(env["TMPDIR"]).glob("cohortgate-*")), "temporary directory left"


def _joined(addr: str, job: str) -> int:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cohortgate.coordinator.cli",
            "status",
            job,
            "--json",
            "--addr",
            addr,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    cohorts = json.loads(done.stdout or "[]") if done.returncode == 0 else []
    return max((c["joined"] for c in cohorts), default=0)


def test_two_torchrun_launches_reusing_one_job_id_are_refused_naming_both(
    tmp_path: Path,
) -> None:
    def start(*extra: str) -> subprocess.Popen[str]:
        args = ["--nproc-per-node", "2", "--rdzv-id", "collide1", "--master-addr", "127.0.0.1"]
        args += ["--master-port", str(free_port()), "--monitor-interval", "0.2", str(TRAIN)]
        return launch([*args, *extra], launch_env(tmp_path, COHORTGATE_ADDR=addr), tmp_path)

    with coordinator_process("--join-deadline", "120", tmp=tmp_path) as (addr, _):
        first = start("--absent-rank", "1")  # holds rank 0, never completes alone
        try:
            give_up = time.monotonic() + 90
            while _joined(addr, "collide1") < 1:
                assert first.poll() is None and time.monotonic() < give_up
                time.sleep(0.3)
            second = start()
        except BaseException:
            kill_group(first)
            raise
        outs = finish([first, second])
    for out in outs:
        assert "formed, all_reduce" not in out, out
        assert "ranks of 2 launches share job id 'collide1'" in out, out
        assert out.count("launch 127.0.0.1:") >= 2, out
