"""Real torchrun jobs whose ranks build models with equal parameter shapes but disagree on
what the shapes do not show: the model config, declared facts, the training code."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, log_events
from tests.launches import (
    TRAIN,
    coordinator_process,
    finish,
    launch,
    launch_env,
    torchrun,
    two_node_args,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
HF = REPO / "examples" / "train_hf.py"


def refused_everywhere(out: str) -> None:
    for rank in range(4):
        assert re.search(rf"\[cohortgate\] rank {rank} on \S+: cohort refused", out), out


def test_gpt2_configs_agree_differ_in_metadata_only_or_differ_in_n_head(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "60", tmp=tmp_path) as (addr, _):
        formed = torchrun(addr, "hf-same", tmp=tmp_path, script=HF)
        metadata = torchrun(
            addr,
            "hf-meta",
            "--vary-rank",
            "1",
            "--vary",
            "_name_or_path=elsewhere",
            tmp=tmp_path,
            script=HF,
        )
        heads = torchrun(
            addr, "hf-heads", "--vary-rank", "3", "--vary", "n_head=2", tmp=tmp_path, script=HF
        )
    assert formed.returncode == 0, formed.stdout
    assert formed.stdout.count("formed") >= 4, formed.stdout
    assert metadata.returncode == 0, metadata.stdout
    assert heads.returncode != 0
    refused_everywhere(heads.stdout)
    assert "ranks disagree on the model config" in heads.stdout, heads.stdout
    assert "config.num_attention_heads: 4 on ranks 0-2, 2 on rank 3" in heads.stdout


def test_gpt2_configs_that_change_the_shapes_are_refused_config_first(tmp_path: Path) -> None:
    """n_layer on one rank (more blocks: missing and extra parameters) and n_embd on another
    (other shapes): the refusal's cause is the config, named first; the shape differences
    follow as what it caused."""
    with coordinator_process("--join-deadline", "60", tmp=tmp_path) as (addr, log):
        layers = torchrun(
            addr, "hf-layers", "--vary-rank", "3", "--vary", "n_layer=3", tmp=tmp_path, script=HF
        )
        width = torchrun(
            addr, "hf-width", "--vary-rank", "1", "--vary", "n_embd=128", tmp=tmp_path, script=HF
        )
        causes = [e.get("cause") for e in log_events(log) if e.get("event") == "cohort refused"]
    assert causes == ["config", "config"], causes
    for run, field, odd in (
        (layers, "num_hidden_layers", "3 on rank 3"),
        (width, "hidden_size", "128 on rank 1"),
    ):
        assert run.returncode != 0
        refused_everywhere(run.stdout)
        # (the ranks print their reports at once: lines of two may interleave)
        report = run.stdout[run.stdout.index("cohortgate refused to form job") :]
        assert "they disagree on the model config, and so built 2 different models" in report
        line = re.search(rf"strict config: config\.\S*{field}: .*{odd}", report)
        assert line is not None, report
        assert line.start() < report.index("differs"), "config first, then the shapes"


def test_llama_rope_theta_and_a_fact_are_refused_by_name(tmp_path: Path) -> None:
    with coordinator_process("--join-deadline", "60", tmp=tmp_path) as (addr, _):
        rope = torchrun(
            addr,
            "hf-rope",
            "--model",
            "llama",
            "--vary-rank",
            "2",
            "--vary",
            "rope_theta=500000.0",
            tmp=tmp_path,
            script=HF,
        )
        fact = torchrun(
            addr,
            "hf-fact",
            "--vary-rank",
            "0",
            "--vary",
            "fact.resume_step=1100",
            tmp=tmp_path,
            script=HF,
        )
    assert rope.returncode != 0
    refused_everywhere(rope.stdout)
    assert re.search(
        r"config\.\S*rope_theta: 10000\.0 on ranks 0-1,3, 500000\.0 on rank 2", rope.stdout
    ), rope.stdout
    assert "weights" not in rope.stdout.split("What to do")[0].lower()
    assert fact.returncode != 0
    assert "facts.resume_step: 1100 on rank 0, 1200 on ranks 1-3" in fact.stdout, fact.stdout


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
        env={
            "GIT_AUTHOR_NAME": "t",
            "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@t",
            "PATH": "/usr/bin:/bin",
        },
    ).stdout.strip()


def two_nodes(addr: str, job: str, scripts: list[Path], tmp: Path) -> list[tuple[int, str]]:
    """One job as two torchrun launches (two nodes of 2 ranks) on this machine, node i
    running scripts[i]: (exit code, output) per node."""
    rdzv = f"127.0.0.1:{free_port()}"
    procs = []
    for script in scripts:
        args = two_node_args(rdzv, job, script, "--steps", "2")
        env = launch_env(tmp, COHORTGATE_ADDR=addr, COHORTGATE_JOB=job)
        procs.append(launch(args, env, tmp))
    outs = finish(procs)
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


def test_a_script_edited_on_one_node_warns_and_refuses_under_strict(tmp_path: Path) -> None:
    # Two nodes (two torchrun launches) of one job, each running its own checkout of the
    # script; node 1's copy has one changed line, and sits at another commit.
    copies = []
    for node in range(2):
        tree = tmp_path / f"node{node}"
        tree.mkdir()
        script = tree / "train.py"
        shutil.copy(TRAIN, script)
        git(tree, "init", "-q")
        git(tree, "add", "train.py")
        git(tree, "commit", "-qm", "train")
        if node == 1:
            script.write_text(script.read_text().replace("default=5", "default=6"))
            git(tree, "commit", "-qam", "hot fix")
        copies.append(script)
    with coordinator_process("--join-deadline", "60", tmp=tmp_path) as (addr, _):
        warned = two_nodes(addr, "code-warn", copies, tmp=tmp_path)
    with coordinator_process("--join-deadline", "60", "--policy", "code=strict", tmp=tmp_path) as (
        addr,
        _,
    ):
        refused = two_nodes(addr, "code-strict", copies, tmp=tmp_path)
    said = "".join(out for _, out in warned)
    assert [code for code, _ in warned] == [0, 0], said
    assert re.search(
        r'code\.script: "train\.py sha256:\w+" on ranks 0-1, "train\.py sha256:\w+" on ranks 2-3',
        said,
    ), said
    assert re.search(r'code\.git\.commit: "\w{12}" on ranks 0-1, "\w{12}" on ranks 2-3', said), said
    out = "".join(out for _, out in refused)
    assert all(code != 0 for code, _ in refused), out
    assert "ranks run different training code" in out and "code.script" in out, out
