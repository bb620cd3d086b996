"""End to end: a real coordinator process and real `torchrun --nproc-per-node 4` jobs on gloo."""

from __future__ import annotations

import os
import re
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from tests.helpers import REPO, log_events
from tests.launches import TRAIN, coordinator_process, finish, launch, launch_env, torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def stamp(event: dict[str, object]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def test_identical_models_form_and_all_reduce(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "60", tmp=tmp_path) as (addr, log):
        result = torchrun(addr, "e2e-formed", "--steps", "3", tmp=tmp_path)
    assert result.returncode == 0, result.stdout
    for rank in range(4):
        assert re.search(
            rf"rank {rank}/4: cohort e2e-formed/1/\w+ formed, all_reduce sum 10, trained 3 steps",
            result.stdout,
        ), result.stdout
    verdicts = [e for e in log_events(log) if e.get("event") == "cohort formed"]
    assert len(verdicts) == 1 and verdicts[0]["reason"] == "[4/4 ranks joined, 1 signature]"


def test_wider_rank_is_refused_on_every_rank_within_seconds(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "60", "--log-level", "debug", tmp=tmp_path) as (
        addr,
        log,
    ):
        result = torchrun(addr, "e2e-wide", "--wide-rank", "2", tmp=tmp_path)
        ended = datetime.now().timestamp()
        events = log_events(log)
    out = result.stdout
    assert result.returncode != 0
    host = os.uname().nodename
    for rank in range(4):
        assert f"[cohortgate] rank {rank} on {host}: cohort refused" in out, out
        # Every rank ends non-zero: 3 from our refusal, or torchrun's SIGTERM once the first
        # refused rank has exited (it stops the rest of the group at the first failure).
        code = re.search(
            rf"rank\s*: {rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*: (-?\d+)", out
        )
        assert code is not None and int(code.group(1)) in (3, -15), out
    assert "differs:   signature" in out and f"1 rank [2] on 1 host {host}" in out
    first = "first difference at position 0: '0.weight' float32[64, 32] vs float32[128, 32]"
    # once from local rank 0, at most once more in torchrun's Root Cause: not 8 times
    assert 1 <= out.count(first) <= 2, out
    root = out[out.index("Root Cause (first observed failure):") :]
    # whichever rank torchrun picks, its error file names the culprit first
    assert f"traceback : rank 2 on {host} built a different model than ranks 0-1,3" in root, root
    last_join = max(stamp(e) for e in events if e.get("event") == "ranks joined")
    # No hang: the whole job is gone well within 10 s of the last join (torchrun included).
    assert ended - last_join < 10, f"{ended - last_join:.1f}s after the last join"


def test_float64_block_is_refused_naming_the_dtypes(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "60", tmp=tmp_path) as (addr, _):
        result = torchrun(addr, "e2e-f64", "--float64-rank", "1", tmp=tmp_path)
    assert result.returncode != 0
    assert "dtype changed: 2" in result.stdout
    assert "'2.weight': float32[64, 64] -> float64[64, 64]" in result.stdout


def test_absent_rank_is_named_at_the_deadline_in_torchruns_root_cause(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "4", tmp=tmp_path) as (addr, _):
        result = torchrun(addr, "e2e-absent", "--absent-rank", "3", tmp=tmp_path)
    out = result.stdout
    assert result.returncode != 0
    assert "missing ranks: 3" in out
    assert "present ranks: 0-2" in out
    root = out[out.index("Root Cause (first observed failure):") :]
    assert "traceback : ranks 3 never joined (join deadline passed with 3/4 ranks)" in root, root


def test_cohortgate_run_is_the_one_command_way_in(tmp_path: Path) -> None:
    args = ["--join-deadline", "60", "--nproc-per-node", "2", "--master-port", "0"]
    env = launch_env(tmp_path, COHORTGATE_HISTORY=str(tmp_path / "history.sqlite"))
    proc = launch([*args, str(TRAIN), "--steps", "2"], env, tmp_path, via="cohortgate run")
    (out,) = finish([proc], timeout=150)
    assert proc.returncode == 0, out
    # no --rdzv-id on one node: a generated job id, printed on stdout with the coordinator
    assert re.search(r"\[cohortgate\] job run-[0-9a-f]{12} \(generated: pass --rdzv-id", out), out
    assert ", coordinator 127.0.0.1:" in out
    assert "\x1b[" not in out, "no ANSI codes in output that is not a terminal"
    assert out.count("all_reduce sum 3, trained 2 steps") == 2


def test_a_rank_seeded_differently_is_refused_when_values_are_verified(tmp_path: Path) -> None:
    with coordinator_process(
        "--join-deadline", "60", "--policy", "weights=strict", tmp=tmp_path
    ) as (addr, _):
        formed = torchrun(addr, "e2e-values-ok", "--verify-values", "--steps", "1", tmp=tmp_path)
        refused = torchrun(addr, "e2e-values", "--verify-values", "--seed-rank", "3", tmp=tmp_path)
    assert formed.returncode == 0, formed.stdout
    assert refused.returncode != 0
    out = refused.stdout
    assert "replicas start from different weights" in out, out
    assert "1 rank(s) [3] on" in out and "first '0.weight'" in out, out


PARALLEL = REPO / "examples" / "train_parallel.py"


def torchrun8(addr: str, job: str, *args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    return torchrun(addr, job, *args, tmp=tmp, nproc=8, script=PARALLEL)


@pytest.mark.timeout(600)
def test_tp2_pp2_dp2_forms_then_wrong_width_and_duplicate_position_are_refused(
    tmp_path: Path,
) -> None:
    with coordinator_process("--join-deadline", "120", tmp=tmp_path) as (addr, _):
        formed = torchrun8(addr, "mesh-ok", tmp=tmp_path)
        assert formed.returncode == 0, formed.stdout
        assert formed.stdout.count("formed mesh-ok/1/") == 8
        assert "all_reduce 8" in formed.stdout

        wide = torchrun8(addr, "mesh-wide", "--wrong-width-rank", "3", tmp=tmp_path)
        assert wide.returncode != 0
        # rank 3 is tp=1 pp=0 dp=1: its fc1 slice [32:72] runs past the 64 rows
        assert (
            "replica dp=1: 'layers.0.fc1.weight': out of bounds: piece [32:72, 0:16] on rank 3"
            in wide.stdout
        )
        assert "replica group tp=1 cp=0 ep=0 pp=0" in wide.stdout

        dup = torchrun8(addr, "mesh-dup", "--duplicate-rank", "5", tmp=tmp_path)
        assert dup.returncode != 0
        assert "position tp=0 cp=0 ep=0 dp=0 pp=1 is held by ranks 4-5" in dup.stdout
