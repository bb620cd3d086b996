"""The documentation (issue 38): the site builds with --strict, its reference names every flag
and metric the code has, the commands it shows take the flags it gives them, and the README is
a front door that links into it."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from prometheus_client import generate_latest

from cohortgate.coordinator.cli.run import RUN_USAGE
from cohortgate.coordinator.service.metrics import Metrics
from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "scripts" / "docs_hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _help(command: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "cohortgate.coordinator.cli", command, "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    ).stdout


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_the_reference_names_every_flag_each_command_prints(site: Path) -> None:
    page = (site / "reference" / "cli" / "index.html").read_text()
    for command in ("serve", "relay", "run", "status", "watch", "explain"):
        flags = set(FLAG.findall(RUN_USAGE if command == "run" else _help(command))) - {"--help"}
        assert flags, command
        # run's page is its usage text, verbatim; the others' a table, a flag per row
        form = "{}" if command == "run" else "<code>{}</code>"
        missing = sorted(f for f in flags if form.format(f) not in page)
        assert missing == [], f"cohortgate {command}: {missing}"
    # and each serve flag's variable, as --help says it
    for var in set(re.findall(r"\$(COHORTGATE_[A-Z_]+)", _help("serve"))):
        assert var in page, var


def test_the_reference_names_every_metric_the_coordinator_exports(site: Path) -> None:
    # (a counter's or histogram's `_created` companion is prometheus_client's, not ours)
    exported = re.findall(
        r"^# TYPE (cohortgate_\w+) ", generate_latest(Metrics().registry).decode(), re.M
    )
    exported = [m for m in exported if not m.endswith("_created")]
    assert len(exported) > 10
    page = (site / "reference" / "metrics" / "index.html").read_text()
    missing = [
        m
        for m in exported
        if f"<code>{m}</code>" not in page and f"<code>{m}_total</code>" not in page
    ]
    assert missing == []


def test_the_reference_shows_every_check_and_a_refusal_the_code_decided(site: Path) -> None:
    from cohortgate.coordinator.decision.checks import POLICED
    from cohortgate.coordinator.decision.verdict import Cause

    page = (site / "reference" / "refusals" / "index.html").read_text()
    for check in POLICED:
        assert f"<code>{check.name}</code>" in page, check.name
    for cause in Cause:
        assert f"<code>{cause.value}</code>" in page, cause
    assert "rank 2 on node1 built a different model than ranks 0-1,3" in page
    # the sharded guide's example, decided by the code as the docs were built
    sharded = (site / "guides" / "sharded-jobs" / "index.html").read_text()
    assert "piece [32:72, 0:16] on rank 3 lies outside the tensor's shape [64, 16]" in sharded


def test_a_flag_the_code_does_not_take_is_found_in_any_page() -> None:
    """Every `cohortgate CMD --flag`, `torchrun --flag` and `examples/NAME.py --flag` the
    README and the docs show (shell blocks and inline `cohortgate ...` spans) is one that
    command takes: the check the docs build runs (scripts/docs_hooks.py), over the README too."""
    hooks = _hooks()
    known = hooks._known()
    bad = {
        str(p.relative_to(REPO)): u
        for p in PAGES
        if (u := hooks.unknown_flags(p.read_text(), known))
    }
    assert bad == {}
    used = [use for p in PAGES for use in hooks.flag_uses(p.read_text(), known)]
    assert len(used) > 15, used
    assert {key for key, _ in used} >= {
        "cohortgate serve",
        "cohortgate run",
        "cohortgate relay",
        "torchrun",
        "examples/train.py",
    }
    # The check can fail: a renamed serve flag, a torchrun option that does not exist, an
    # example's flag that is not its own (after a command's own, which are still checked).
    renamed = (
        "```sh\ncohortgate serve --join-timeout 5\n"
        "COHORTGATE_JOB=x torchrun --nodes 2 t.py --steps 5\n"
        "cohortgate run --nproc-per-node 2 examples/train.py --stall-rank 1\n```\n"
        "and inline: `cohortgate explain JOB --audit`\n"
    )
    assert hooks.unknown_flags(renamed, known) == [
        "cohortgate serve --join-timeout",
        "torchrun --nodes",
        "examples/train.py --stall-rank",
        "cohortgate explain --audit",
    ]


def test_every_code_block_says_its_language_and_python_ones_run_or_are_sketches(
    tmp_path: Path,
) -> None:
    """A Python block runs here (and must exit 0) unless its title calls it a sketch (a part
    of a training script: it needs a running job); a sketch still compiles."""
    block = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```", re.M | re.S)
    ran = 0
    for page in PAGES:
        for found in block.finditer(page.read_text()):
            language, info, code = found.groups()
            assert language, f"{page}: a code block without a language:\n{code[:200]}"
            if language != "python":
                continue
            compile(code, str(page), "exec")
            if "sketch" in info:
                continue
            done = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=tmp_path,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            assert done.returncode == 0, f"{page}:\n{code}\n{done.stderr}"
            ran += 1
    assert ran >= 1


def test_the_readme_is_a_front_door_into_the_docs() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    # The README's two commands are the ones CI and the demo run.
    assert "make demo" in readme and "make test" in readme
    assert (REPO / ".ci" / "run").read_text().rstrip().endswith("exec make test")
    links = re.findall(r"\]\((docs/[^)#]+)(?:#[^)]*)?\)", readme)
    assert all((REPO / link).is_file() for link in links), [
        link for link in links if not (REPO / link).is_file()
    ]
    for page in (
        "get-started/multi-node.md",
        "guides/high-availability.md",
        "guides/weights-and-audits.md",
    ):
        assert f"docs/{page}" in links, page
    # Its example refusal is the one the code decides (the docs' generated example).
    assert _hooks().example_refusal() in readme


def test_the_pictures_are_drawn_from_the_real_page_and_the_dashboard(site: Path) -> None:
    """The status page as Chromium drew it from a real coordinator holding 3 of 6 ranks, and
    the Grafana dashboard drawn from its JSON (every panel, by title)."""
    import json

    png = (site / "img" / "status.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    svg = (site / "img" / "dashboard.svg").read_text()
    board = json.loads((REPO / "deploy" / "grafana" / "cohortgate-dashboard.json").read_text())
    titles = [p["title"] for p in board["panels"]]
    assert titles and all(f">{t}</text>" in svg for t in titles)
    operating = (site / "guides" / "operating" / "index.html").read_text()
    assert (
        'src="../../img/status.png"' in operating and 'src="../../img/dashboard.svg"' in operating
    )
