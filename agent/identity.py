"""What a rank says about itself beyond its parameters: its training code, and helpers for
facts (a tokenizer's fingerprint). Nothing heavy at import; git runs once per join."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from coordinator.contract.fingerprint import canonical

# Packages whose version changes numerics: always named when installed.
NUMERICS_PACKAGES = ("torch", "transformers", "numpy", "triton", "flash-attn", "deepspeed")


def _git(directory: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def code_fields(packages: Iterable[str] = ()) -> dict[str, str]:
    """The launching script (`__main__`'s file: its path in its git work tree, or its name,
    and a SHA-256 of its text), the work tree's commit and whether it has local changes, and
    the versions of NUMERICS_PACKAGES plus `packages` (and COHORTGATE_PACKAGES,
    comma-separated) that are installed."""
    fields: dict[str, str] = {}
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script:
        path = Path(script).resolve()
        top = _git(path.parent, "rev-parse", "--show-toplevel")
        name = str(path.relative_to(top)) if top and path.is_relative_to(top) else path.name
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        except OSError:
            digest = "unreadable"
        fields["script"] = canonical(f"{name} sha256:{digest}")
        if top:
            commit = _git(path.parent, "rev-parse", "HEAD")
            dirty = _git(path.parent, "status", "--porcelain", "--untracked-files=no")
            if commit:
                suffix = " (local changes)" if dirty else ""
                fields["git.commit"] = canonical(f"{commit[:12]}{suffix}")
    named = [*NUMERICS_PACKAGES, *packages]
    named += [p.strip() for p in os.environ.get("COHORTGATE_PACKAGES", "").split(",")]
    for package in dict.fromkeys(p for p in named if p):
        try:
            fields[f"package.{package}"] = canonical(metadata.version(package))
        except metadata.PackageNotFoundError:
            continue
    return fields


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """'sha256:<hex>' of what makes a Hugging Face tokenizer encode text as it does: its
    class, vocabulary, added and special tokens, and (fast tokenizers) the whole pipeline
    (normalizer, pre-tokenizer, model with its merges, post-processor). Pass it as a fact:
    `agent.join(model, facts={"tokenizer": tokenizer_fingerprint(tok)})`; the tokenizer
    itself is never sent."""
    parts: dict[str, Any] = {"class": type(tokenizer).__name__}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        parts["pipeline"] = json.loads(backend.to_str())
    else:
        parts["vocab"] = sorted(tokenizer.get_vocab().items())
    added = getattr(tokenizer, "get_added_vocab", None)
    parts["added"] = sorted(added().items()) if callable(added) else []
    parts["special"] = {
        k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())
    }
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
