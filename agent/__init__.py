"""cohortgate's agent: what a rank imports. Light at import; torch is touched only when called."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from coordinator.contract.diff import ManifestDiff, diff
from coordinator.contract.layout import Layout, LayoutBuilder, config_fingerprint, layout
from coordinator.contract.manifest import Entry, Kind, Manifest, ManifestError

if TYPE_CHECKING:
    from agent.audit import ReplicasDiverged
    from agent.cohort import Cohort, CohortRefused, init_process_group, join
    from agent.dtensor import dtensor_pieces
    from agent.identity import tokenizer_fingerprint
    from agent.signature import manifest
    from agent.torchrun import CohortgateError

__all__ = [
    "Cohort",
    "CohortRefused",
    "CohortgateError",
    "Entry",
    "Kind",
    "Layout",
    "LayoutBuilder",
    "Manifest",
    "ManifestDiff",
    "ManifestError",
    "ReplicasDiverged",
    "config_fingerprint",
    "diff",
    "dtensor_pieces",
    "init_process_group",
    "join",
    "layout",
    "manifest",
    "tokenizer_fingerprint",
]

# Loaded on first use: importing agent must not pull in torch or grpc.
_LAZY = {
    "manifest": "agent.signature",
    "dtensor_pieces": "agent.dtensor",
    "join": "agent.cohort",
    "init_process_group": "agent.cohort",
    "Cohort": "agent.cohort",
    "CohortRefused": "agent.cohort",
    "CohortgateError": "agent.torchrun",
    "ReplicasDiverged": "agent.audit",
    "tokenizer_fingerprint": "agent.identity",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agent' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
