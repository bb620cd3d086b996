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

from cohortgate.coordinator.contract.digests import files_field
from cohortgate.coordinator.contract.fingerprint import canonical

# Packages whose version changes numerics: always named when installed.
NUMERICS_PACKAGES = ("torch", "transformers", "numpy", "triton", "flash-attn", "deepspeed")
# How long one git command may take (a wedged network file system, a held lock): past it,
# the script is named by its file alone and the join goes on.
GIT_TIMEOUT_S = 10.0


def _git(directory: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(directory), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# The local code files of the last code_fields() call: what this rank uploads when the
# coordinator asks (DigestRequest.files), to name the files that differ between ranks.
LOCAL_FILES: list[tuple[str, bytes]] = []


def code_fields(packages: Iterable[str] = ()) -> dict[str, str]:
    """The launching script (`__main__`'s file: its path in its git work tree, or its name,
    and a SHA-256 of its text), the work tree's commit and whether it has local changes, the
    local modules it imported from that work tree (`modules`: one combined digest; see
    local_files), and the versions of NUMERICS_PACKAGES plus `packages` (and
    COHORTGATE_PACKAGES, comma-separated) that are installed."""
    fields: dict[str, str] = {}
    script = getattr(sys.modules.get("__main__"), "__file__", None)
    if script:
        fields.update(_script_fields(Path(script).resolve()))
    named = [*NUMERICS_PACKAGES, *packages]
    named += [p.strip() for p in os.environ.get("COHORTGATE_PACKAGES", "").split(",")]
    for package in dict.fromkeys(p for p in named if p):
        try:
            fields[f"package.{package}"] = canonical(metadata.version(package))
        except metadata.PackageNotFoundError:
            continue
    return fields


def _script_fields(path: Path) -> dict[str, str]:
    fields: dict[str, str] = {}
    top = _git(path.parent, "rev-parse", "--show-toplevel")
    name = str(path.relative_to(top)) if top and path.is_relative_to(top) else path.name
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    except OSError:
        digest = "unreadable"
    fields["script"] = canonical(f"{name} sha256:{digest}")
    if not top:
        return fields
    commit = _git(path.parent, "rev-parse", "HEAD")
    dirty = _git(path.parent, "status", "--porcelain", "--untracked-files=no")
    if commit:
        suffix = " (local changes)" if dirty else ""
        fields["git.commit"] = canonical(f"{commit[:12]}{suffix}")
    files = local_files(Path(top), exclude=path)
    LOCAL_FILES[:] = files
    if files:
        fields["modules"] = files_field(files)
    return fields


def local_files(top: Path, exclude: Path | None = None) -> list[tuple[str, bytes]]:
    """(path in the work tree, SHA-256 of its bytes) of each module in sys.modules whose
    file git tracks in the work tree `top`, in path order: the script's own helpers, with
    their uncommitted edits. Never a file inside a virtual environment (below a folder
    holding pyvenv.cfg, or a site-packages), nor `exclude` (the script: its own field)."""
    listed = _git(top, "ls-files", "-z")
    if not listed:
        return []
    tracked = set(listed.split("\0"))
    root = os.path.realpath(top)
    out: dict[str, bytes] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not file.endswith(".py"):
            continue
        if "site-packages" in file or "dist-packages" in file:
            continue  # installed packages (most of sys.modules): no realpath for them
        real = os.path.realpath(file)
        if not real.startswith(root + os.sep) or (exclude and real == str(exclude)):
            continue
        rel = os.path.relpath(real, root)
        if rel in out or rel not in tracked or _in_venv(Path(root), Path(rel)):
            continue
        try:
            out[rel] = hashlib.sha256(Path(real).read_bytes()).digest()
        except OSError:
            continue
    return sorted(out.items())


def _in_venv(root: Path, rel: Path) -> bool:
    parts = rel.parts[:-1]
    if any(p in ("site-packages", "dist-packages") for p in parts):
        return True
    return any((root.joinpath(*parts[: i + 1]) / "pyvenv.cfg").exists() for i in range(len(parts)))


TOKENIZER_FORMAT = "cohortgate.tokenizer.v1"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """'sha256:<hex>' of what makes a Hugging Face tokenizer encode text as it does: its
    class, vocabulary, added and special tokens, and (fast tokenizers) the whole pipeline
    (normalizer, pre-tokenizer, model with its merges, post-processor). Pass it as a fact:
    `cohortgate.join(model, facts={"tokenizer": tokenizer_fingerprint(tok)})`; the tokenizer
    itself is never sent.

    The fingerprint's own format is versioned (TOKENIZER_FORMAT, hashed in): a later
    cohortgate that reads a tokenizer differently changes it on purpose, never by accident.
    The pipeline is the `tokenizers` library's own serialization: ranks with two versions of
    that library can differ here, as they can in how they tokenize."""
    parts: dict[str, Any] = {"format": TOKENIZER_FORMAT, "class": type(tokenizer).__name__}
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
