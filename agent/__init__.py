"""cohortgate's agent: what a rank imports. Light at import; torch is touched only when called."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coordinator.diff import ManifestDiff, diff
from coordinator.manifest import Entry, Kind, Manifest, ManifestError

if TYPE_CHECKING:
    from agent.signature import manifest

__all__ = [
    "Entry",
    "Kind",
    "Manifest",
    "ManifestDiff",
    "ManifestError",
    "diff",
    "manifest",
]

_LAZY = {"manifest": "agent.signature"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agent' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
