"""The `code` check covers the local modules a script imports from its own git work tree:
two nodes whose checkouts carry different uncommitted edits to a helper module are told
apart, and the refusal names the file (real `cohortgate run` launches, a relay per node)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, python_c
from tests.launches import coordinator_process, finish, launch, launch_env, two_node_args

SCRIPT = """
import sys

import torch
from torch import nn

import cohortgate
import helper  # a local module of this work tree

model = nn.Linear(4, 4)
try:
    cohort = cohortgate.init_process_group(model, backend="gloo")
except cohortgate.CohortRefused:
    sys.exit(3)
torch.distributed.destroy_process_group()
print(f"rank {cohort.rank}: formed with lr {helper.lr()}", flush=True)
"""
HELPER = "def lr() -> float:\n    return 0.1\n"


def git(where: Path, *args: str) -> str:
    command = ["git", "-C", str(where), "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def checkout(tmp: Path) -> Path:
    """A git work tree holding the script and its helper module, committed."""
    origin = tmp / "origin"
    origin.mkdir()
    (origin / "train_code.py").write_text(SCRIPT)
    (origin / "helper.py").write_text(HELPER)
    (origin / "notes.txt").write_text("not code\n")
    git(origin, "init", "-q")
    git(origin, "add", ".")
    git(origin, "commit", "-qm", "train")
    return origin


def clone(origin: Path, where: Path) -> Path:
    git(origin.parent, "clone", "-q", str(origin), str(where))
    return where


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_two_nodes_with_different_uncommitted_helper_edits_are_told_apart_naming_the_file(
    tmp_path: Path,
) -> None:
    origin = checkout(tmp_path)
    nodes = [clone(origin, tmp_path / f"node{n}") for n in range(2)]
    for n, node in enumerate(nodes):  # both dirty: the commit field says the same for both
        (node / "helper.py").write_text(HELPER.replace("0.1", f"0.{n + 2}"))
    with coordinator_process("--join-deadline", "120", "--policy", "code=strict", tmp=tmp_path) as (
        addr,
        _,
    ):
        rdzv = f"127.0.0.1:{free_port()}"
        procs = []
        for node in nodes:
            args = two_node_args(rdzv, "code-helper", node / "train_code.py")
            env = launch_env(tmp_path, PYTHONPATH=str(REPO))
            procs.append(launch(["--coordinator", addr, *args], env, node, via="cohortgate run"))
        outs = finish(procs)
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode != 0, out
        assert "through this node's relay" in out, out
        assert "ranks run different training code: code.modules: 1 file differs: helper.py" in (
            out
        ), out
        assert "helper.py on ranks 2-3" in out and "against ranks 0-1" in out, out
        assert "formed with lr" not in out


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_same_edits_on_both_nodes_form(tmp_path: Path) -> None:
    origin = checkout(tmp_path)
    nodes = [clone(origin, tmp_path / f"node{n}") for n in range(2)]
    for node in nodes:
        (node / "helper.py").write_text(HELPER.replace("0.1", "0.5"))
    with coordinator_process("--join-deadline", "120", "--policy", "code=strict", tmp=tmp_path) as (
        addr,
        _,
    ):
        rdzv = f"127.0.0.1:{free_port()}"
        procs = [
            launch(
                two_node_args(rdzv, "code-same", node / "train_code.py"),
                launch_env(tmp_path, PYTHONPATH=str(REPO), COHORTGATE_ADDR=addr),
                node,
            )
            for node in nodes
        ]
        outs = finish(procs)
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out
        assert out.count("formed with lr 0.5") == 2, out


def test_local_files_are_the_tracked_modules_of_the_work_tree_never_a_venv(
    tmp_path: Path,
) -> None:
    tree = tmp_path / "tree"
    for rel in (
        "pkg/__init__.py",
        "pkg/mod.py",
        "untracked.py",
        ".venv/lib/python3/site-packages/vendored.py",
        "env2/lib/inside.py",
        "main.py",
    ):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(f"NAME = {rel!r}\n")
    (tree / "env2" / "pyvenv.cfg").write_text("home = /usr\n")
    git(tree.parent, "init", "-q", str(tree))
    git(tree, "add", "-f", "pkg", ".venv", "env2", "main.py")
    git(tree, "commit", "-qm", "x")
    (tree / "pkg" / "mod.py").write_text("NAME = 'edited, not committed'\n")
    said = python_c(
        "import sys, importlib.util\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(tree)!r}, "
        f"{str(tree / '.venv/lib/python3/site-packages')!r}, {str(tree / 'env2/lib')!r}]\n"
        "import pkg.mod, untracked, vendored, inside, main\n"
        "from pathlib import Path\n"
        "from cohortgate.agent.identity import local_files\n"
        "from cohortgate.coordinator.contract.digests import files_field\n"
        f"files = local_files(Path({str(tree)!r}), exclude=Path({str(tree / 'main.py')!r}))\n"
        "print([p for p, _ in files]); print(files_field(files))\n"
    )
    listed, field = said.splitlines()
    assert listed == "['pkg/__init__.py', 'pkg/mod.py']"
    assert field.startswith("2 files sha256:")
