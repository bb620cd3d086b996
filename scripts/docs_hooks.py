"""MkDocs hook: the reference pages' tables come from the code at build time, never typed twice.

A page holds a marker `<!-- generated: NAME -->`; `on_page_markdown` replaces it with what
`GENERATED[NAME]()` renders from the code: the CLI's flags (from its argparse parsers, which
are generated from the settings models), the metrics (from a fresh registry), the checks and
their words (from the check registry) and the gRPC API (from the .proto's comments).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def cli() -> str:
    """Every command with every flag: its help says its meaning, default and variable."""
    from cohortgate.coordinator.cli.run import RUN_USAGE

    out = []
    for name, parser in _CHECKER.subparsers().items():
        out.append(f"## cohortgate {name}\n")
        if name == "run":  # its own usage text: the rest goes to torchrun unchanged
            out.append(f"```text\n{RUN_USAGE}```\n")
            continue
        if parser.description:
            out.append(_cell(parser.description) + "\n")
        rows = ["| flag | meaning (default; variable) |", "| --- | --- |"]
        for action in parser._actions:
            if not action.option_strings or "--help" in action.option_strings:
                continue
            flags = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.metavar and action.nargs != 0:
                flags += f" `{action.metavar}`"
            elif action.choices:
                flags += " `" + "|".join(map(str, action.choices)) + "`"
            positional = ""
            rows.append(f"| {flags} | {_cell(action.help or '')}{positional} |")
        positional_rows = [
            f"| `{a.metavar or a.dest}` | {_cell(a.help or '')} |"
            for a in parser._actions
            if not a.option_strings and a.help != argparse.SUPPRESS
        ]
        out.append("\n".join(rows[:2] + positional_rows + rows[2:]) + "\n")
    return "\n".join(out)


def metrics() -> str:
    """Every `cohortgate_*` metric the coordinator exports, from a fresh registry."""
    from cohortgate.coordinator.service.metrics import Metrics

    rows = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    seen = set()
    for collector in list(Metrics().registry._collector_to_names):
        labels = ", ".join(f"`{n}`" for n in getattr(collector, "_labelnames", ()))
        for family in collector.describe():
            if family.name in seen:
                continue
            seen.add(family.name)
            name = family.name + ("_total" if family.type == "counter" else "")
            rows.append(f"| `{name}` | {family.type} | {labels} | {_cell(family.documentation)} |")
    return "\n".join(rows[:2] + sorted(rows[2:])) + "\n"


def checks() -> str:
    """The checks in the order they run, with their default level and their words."""
    from cohortgate.coordinator.decision.checks import CHECKS, TRAINING

    out = ["| check | default | cause | what it compares |", "| --- | --- | --- | --- |"]
    out += [f"| `{c.name}` | {c.default} | `{c.cause}` | {_cell(c.help)} |" for c in CHECKS]
    out.append("")
    for c in CHECKS:
        out.append(f"### `{c.name}`\n")
        out.append(f"- refused because: {_cell(c.refusal)}")
        out.append(f"- the report opens: *all N ranks joined, but {_cell(c.head)}.*")
        out.append(f"- What to do: {_cell(c.advice)}\n")
    out += [
        "Judged during training, never at formation (their level is set the same way):",
        "",
        "| check | default | what it watches |",
        "| --- | --- | --- |",
    ]
    out += [f"| `{c.name}` | {c.default} | {_cell(c.help)} |" for c in TRAINING]
    return "\n".join(out)


def causes() -> str:
    """Every cause a verdict can carry (`Verdict.cause` on the wire, `cause` in history)."""
    from cohortgate.coordinator.decision.verdict import Cause

    return "\n".join(f"- `{c.value}`" for c in Cause) + "\n"


def _decided(world: int, differ: dict[int, dict[str, Any]], joined: int | None = None) -> str:
    """The headline and report the decision gives a cohort of `world` ranks on nodes of 2,
    where `differ[rank]` overrides what that rank sent (`width` of its layer, `agreed`
    fingerprints, `runtime`); `joined`: only the first ranks joined, decided at the deadline."""
    from cohortgate.coordinator.contract.fingerprint import config_fields, fields_of, flatten
    from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
    from cohortgate.coordinator.decision.cohort import CohortState, Member
    from cohortgate.coordinator.decision.formation import FormationOptions
    from cohortgate.coordinator.decision.report import judge

    def manifest(width: int) -> Manifest:
        return Manifest.of(
            [
                Entry(Kind.PARAMETER, "fc.weight", "float32", (width, 4), True),
                Entry(Kind.PARAMETER, "fc.bias", "float32", (width,), True),
            ]
        )

    cohort = CohortState("job-42", 1, world, first_join_at=0.0)
    for rank in range(world if joined is None else joined):
        sent = {
            "width": 8,
            "runtime": {"device_type": "cuda", "torch_version": "2.13.0"},
            "config": {"num_attention_heads": 32, "hidden_size": 4096},
            "facts": {"data": "mix-v3", "resume_step": 1200},
            **differ.get(rank, {}),
        }
        m = manifest(sent["width"])
        agreed = {
            "config": fields_of(config_fields(sent["config"])),
            "facts": fields_of(flatten(sent["facts"])),
        }
        member = Member(
            rank=rank,
            host=f"node{rank // 2}",
            pid=1000 + rank,
            incarnation=f"inc{rank}",
            signature=m.signature(),
            manifest_entries=len(m),
            runtime=sent["runtime"],
            agreed=agreed,
        )
        cohort.add(member, 0.0)
        cohort.manifests[m.signature()] = m
    options = FormationOptions(join_deadline_s=600.0)
    _, verdict = judge(cohort, 1.0 if joined is None else 601.0, options)
    assert verdict is not None and verdict.report, f"the example was not refused: {differ}"
    return f"```text\n{verdict.headline}\n\n{verdict.report}\n```\n"


def sharded_refusal() -> str:
    """The guide's sharded example, decided here: 8 ranks at tp=2 pp=2 dp=2, each holding
    its fc1 slice (column-parallel) and fc1 bias; rank 3 builds its slice 8 rows too wide."""
    from cohortgate.coordinator.contract.layout import layout
    from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
    from cohortgate.coordinator.decision.cohort import CohortState, Member
    from cohortgate.coordinator.decision.formation import FormationOptions
    from cohortgate.coordinator.decision.report import judge

    hidden, dim = 64, 16
    cohort = CohortState("job-7", 1, 8, first_join_at=0.0)
    for rank in range(8):
        decl = layout(rank, tp=2, pp=2, dp=2)
        tp, pp = decl.position["tp"], decl.position["pp"]
        rows = hidden // 2 + (8 if rank == 3 else 0)  # its piece as wide as its slice
        decl.shard(f"layers.{pp}.fc1.weight", (hidden, dim), (tp * hidden // 2, 0), (rows, dim))
        decl.split(f"layers.{pp}.fc1.bias", (hidden,), dim=0, index=tp, parts=2)
        m = Manifest.of(
            [
                Entry(Kind.PARAMETER, "fc1.weight", "float32", (rows, dim), True),
                Entry(Kind.PARAMETER, "fc1.bias", "float32", (hidden // 2,), True),
            ]
        )
        member = Member(
            rank=rank,
            host=f"node{rank // 4}",
            pid=1000 + rank,
            incarnation=f"inc{rank}",
            signature=m.signature(),
            manifest_entries=len(m),
            layout=decl.build(),
        )
        cohort.add(member, 0.0)
        cohort.manifests[m.signature()] = m
    _, verdict = judge(cohort, 1.0, FormationOptions())
    assert verdict is not None and verdict.report, "the sharded example was not refused"
    return f"```text\n{verdict.headline}\n\n{verdict.report}\n```\n"


EXAMPLES: dict[str, tuple[str, Callable[[], str]]] = {
    "signature_mismatch": (
        "rank 2 built a wider layer",
        lambda: _decided(4, {2: {"width": 16}}),
    ),
    "config": (
        "rank 3 loaded a config with another head count",
        lambda: _decided(4, {3: {"config": {"num_attention_heads": 16, "hidden_size": 4096}}}),
    ),
    "facts": (
        "rank 1 resumes from another checkpoint step",
        lambda: _decided(4, {1: {"facts": {"data": "mix-v3", "resume_step": 1100}}}),
    ),
    "runtime": (
        "rank 0 runs on the CPU",
        lambda: _decided(4, {0: {"runtime": {"device_type": "cpu", "torch_version": "2.13.0"}}}),
    ),
    "deadline": (
        "2 of 4 ranks joined by the join deadline",
        lambda: _decided(4, {}, joined=2),
    ),
}


def example_refusal() -> str:
    """A real refusal, decided here: rank 2 of 4 built a wider layer."""
    return EXAMPLES["signature_mismatch"][1]()


def example_refusals() -> str:
    """A refusal per cause that a few ranks' joins show, each decided here."""
    return "\n".join(
        f"### `{cause}`: {what}\n\n{render()}" for cause, (what, render) in EXAMPLES.items()
    )


def grpc_api() -> str:
    """The services and their methods with the comments above them in cohort.proto."""
    proto = REPO / "proto" / "cohortgate" / "coordinator" / "api" / "v1" / "cohort.proto"
    out, comment = [], []
    for line in proto.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("//"):
            comment.append(stripped.removeprefix("//").strip())
            continue
        service = re.match(r"service (\w+)", stripped)
        rpc = re.match(r"rpc (\w+)\((stream )?(\w+)\) returns \((stream )?(\w+)\)", stripped)
        if service:
            out.append(f"\n## `{service.group(1)}`\n\n{' '.join(comment)}\n")
            out.append("| method | request | response | what it does |\n| --- | --- | --- | --- |")
        elif rpc:
            req = f"{rpc.group(2) or ''}`{rpc.group(3)}`"
            resp = f"{rpc.group(4) or ''}`{rpc.group(5)}`"
            out.append(f"| `{rpc.group(1)}` | {req} | {resp} | {_cell(' '.join(comment))} |")
        comment = []
    return "\n".join(out) + "\n"


def dashboard_svg() -> str:
    """The Grafana dashboard (deploy/grafana/) drawn from its JSON: each panel where Grafana
    places it (a 24-column grid), with its title, kind and first query."""
    import html
    import json

    board = json.loads((REPO / "deploy" / "grafana" / "cohortgate-dashboard.json").read_text())
    col, row, pad = 40, 26, 4
    height = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"]) * row
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{24 * col}" height="{height + 30}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="100%" height="100%" fill="#111217"/><text x="8" y="20" fill="#ccc" '
        f'font-size="15">{html.escape(board["title"])} (Grafana, deploy/grafana/)</text>',
    ]
    for panel in board["panels"]:
        g = panel["gridPos"]
        x, y, w, h = g["x"] * col, g["y"] * row + 30, g["w"] * col - pad, g["h"] * row - pad
        query = next((t.get("expr", "") for t in panel.get("targets", [])), "")
        if len(query) > w // 7:
            query = query[: w // 7 - 1] + "…"
        parts += [
            f'<rect x="{x}" y="{y}" width="{w}" height="{h}" rx="3" fill="#181b1f" '
            'stroke="#2c3235"/>',
            f'<text x="{x + 8}" y="{y + 18}" fill="#d8d9da" font-weight="bold">'
            f"{html.escape(panel.get('title', ''))}</text>",
            f'<text x="{x + 8}" y="{y + 36}" fill="#8e8e8e">{html.escape(panel["type"])}</text>',
            f'<text x="{x + 8}" y="{y + h - 10}" fill="#6e9fff" font-family="monospace" '
            f'font-size="10">{html.escape(query)}</text>',
        ]
    return "\n".join([*parts, "</svg>"]) + "\n"


RANK = """
import cohortgate, torch
cohortgate.join(torch.nn.Linear(4, 4), timeout_s=120)
"""


def status_png() -> bytes:
    """The status page of a real coordinator (`cohortgate serve`) holding a job of 6 ranks
    of which 3 joined, as headless Chromium draws it."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    import time

    chromium = shutil.which("chromium")
    if chromium is None:
        raise RuntimeError("the status page's picture needs chromium (make system-deps)")
    with tempfile.TemporaryDirectory() as tmp:
        ports = Path(tmp) / "ports"
        env = {**os.environ, "HOME": tmp, "PYTHONPATH": str(REPO)}
        serve = [sys.executable, "-m", "cohortgate.coordinator.cli", "serve", "--listen"]
        serve += ["127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--history", "off"]
        serve += ["--port-file", str(ports), "--log-format", "json"]
        procs = [subprocess.Popen(serve, env=env, stdout=subprocess.DEVNULL)]
        try:
            give_up = time.monotonic() + 30
            while len(ports.read_text().split() if ports.exists() else []) < 2:
                if time.monotonic() > give_up:
                    raise RuntimeError("the docs' coordinator did not start")
                time.sleep(0.05)
            grpc_port, http_port = ports.read_text().split()[:2]
            rank_env = {**env, "COHORTGATE_ADDR": f"127.0.0.1:{grpc_port}", "WORLD_SIZE": "6"}
            rank_env |= {"COHORTGATE_JOB": "llama-70b-sft", "MASTER_ADDR": "127.0.0.1"}
            for rank in (0, 1, 4):
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", RANK],
                        env={**rank_env, "RANK": str(rank)},
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
            url = f"http://127.0.0.1:{http_port}/status"
            shot = Path(tmp) / "status.png"
            flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
            flags += [f"--user-data-dir={tmp}/profile", "--window-size=1100,420"]
            while time.monotonic() < give_up + 60:  # until the three ranks show
                dom = subprocess.run(
                    [chromium, *flags, "--dump-dom", url], capture_output=True, text=True
                ).stdout
                if "3/6" in dom:
                    break
                time.sleep(0.5)
            subprocess.run([chromium, *flags, f"--screenshot={shot}", url], capture_output=True)
            return shot.read_bytes()
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


def mutation_scope() -> str:
    """What `make mutation` mutates and which tests it runs them against."""
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mutmut"]
    code = ", ".join(f"`{p}`" for p in config["source_paths"])
    tests = ", ".join(f"`{Path(t).name}`" for t in config["pytest_add_cli_args_test_selection"])
    n = len(config["pytest_add_cli_args_test_selection"])
    return f"- mutated: {code}\n- against the {n} test files: {tests}\n"


GENERATED: dict[str, Callable[[], str]] = {
    "cli": cli,
    "metrics": metrics,
    "checks": checks,
    "causes": causes,
    "example-refusal": example_refusal,
    "example-refusals": example_refusals,
    "sharded-refusal": sharded_refusal,
    "grpc-api": grpc_api,
    "mutation-scope": mutation_scope,
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    def render(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in GENERATED:
            raise KeyError(f"docs: no generated section {name!r} (known: {sorted(GENERATED)})")
        return GENERATED[name]()

    return MARKER.sub(render, markdown)


def _commands_checker() -> ModuleType:
    """scripts/docs_commands.py, loaded by its path as MkDocs loads this hook."""
    path = Path(__file__).resolve().parent / "docs_commands.py"
    spec = importlib.util.spec_from_file_location("docs_commands", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_CHECKER = _commands_checker()
_known, flag_uses = _CHECKER.known_commands, _CHECKER.flag_uses
unknown_flags = _CHECKER.unknown_flags


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, "img/dashboard.svg", content=dashboard_svg()))
    files.append(File.generated(config, "img/status.png", content=status_png()))
    known = _known()  # once: each example script's --help imports torch
    bad = {
        f.src_uri: unknown
        for f in files.documentation_pages()
        if (unknown := unknown_flags(Path(f.abs_src_path).read_text(), known))
    }
    if bad:
        raise ValueError(f"docs name flags their commands do not take: {bad}")
    return files
