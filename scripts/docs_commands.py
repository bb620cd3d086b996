"""Commands in the docs, checked against the code: a flag renamed in the code (or an option
an example script no longer takes) fails the docs build and tests/test_docs.py. Loaded by
scripts/docs_hooks.py."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def subparsers() -> dict[str, argparse.ArgumentParser]:
    """Every `cohortgate` command's parser, by name."""
    from cohortgate.coordinator.cli.main import build_parser

    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


# -- commands in the docs: a flag renamed in the code fails the build ------------------------
BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELL = ("sh", "bash", "console")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def known_commands() -> dict[str, set[str]]:
    """command -> the options it takes; `run` takes its own and torchrun's; each example
    script (examples/NAME.py) its own, from its --help."""
    from torch.distributed.run import get_args_parser

    from cohortgate.coordinator.cli.run import OWN_OPTIONS

    known = {f"cohortgate {name}": _options(p) for name, p in subparsers().items()}
    torchrun = _options(get_args_parser())
    known["cohortgate run"] = set(OWN_OPTIONS) | torchrun
    known["torchrun"] = torchrun
    known.update(_example_options())
    return known


def _example_options() -> dict[str, set[str]]:
    """examples/NAME.py -> the options its --help names (the scripts that parse arguments;
    the others are never run here)."""

    out = {}
    for script in sorted((REPO / "examples").glob("*.py")):
        if "argparse" not in script.read_text():
            continue
        done = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise ValueError(f"{script.name} --help failed: {done.stderr[-500:]}")
        out[f"examples/{script.name}"] = set(re.findall(r"--[\w-]+", done.stdout))
    return out


def _commands(script: str) -> list[list[str]]:
    """The simple commands of a shell snippet (continuations joined, comments dropped)."""
    import shlex

    out = []
    for line in script.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        command: list[str] = []
        for word in [*words, ";"]:
            if word in (";", "&&", "||", "|", "&"):
                out.append(command)
                command = []
            else:
                command.append(word)
    return [c for c in out if c]


INLINE = re.compile(r"`(cohortgate [^`]+)`")


def flag_uses(markdown: str, known: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(command, --flag) for each flag a known command is given in the shell blocks of
    `markdown` and in its inline `cohortgate ...` spans. A command's options end at the
    script it runs (an example script's are then its own: checked as that script's)."""
    snippets = [b.group(2) for b in BLOCK.finditer(markdown) if b.group(1) in SHELL]
    outside = BLOCK.sub("", markdown)
    snippets += INLINE.findall(outside)
    found = []
    for snippet in snippets:
        for command in _commands(snippet):
            words = [w for w in command if "=" not in w or w.startswith("-")]  # VAR=x cmd
            found += _uses(words, known)
    return found


def _uses(words: list[str], known: dict[str, set[str]]) -> list[tuple[str, str]]:
    found = []
    for i, word in enumerate(words):
        name = Path(word).name
        if name == "cohortgate" and i + 1 < len(words):
            key = f"cohortgate {words[i + 1]}"
        elif word.endswith(".py") and f"examples/{name}" in known:
            key = f"examples/{name}"
        else:
            key = name
        if key not in known:
            continue
        for j, arg in enumerate(words[i + 1 :], start=i + 1):
            if arg.endswith(".py") or arg == "-m":
                found += _uses(words[j:], known) if arg.endswith(".py") else []
                break
            if arg.startswith("--"):
                found.append((key, arg.split("=", 1)[0]))
        break
    return found


def unknown_flags(markdown: str, known: dict[str, set[str]] | None = None) -> list[str]:
    """`cohortgate COMMAND --flag`, `torchrun --flag` and `examples/NAME.py --flag` in the
    shell blocks (and inline `cohortgate ...` spans) of `markdown` whose flag the command
    does not take."""
    known = known_commands() if known is None else known
    return [f"{key} {flag}" for key, flag in flag_uses(markdown, known) if flag not in known[key]]
