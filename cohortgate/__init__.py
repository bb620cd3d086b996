"""cohortgate: what a training script imports (`import cohortgate; cohortgate.join(model)`).

Light at import: neither torch nor grpc nor the server is loaded until a name that needs it is
used. The rank library is `cohortgate.agent`, the service `cohortgate.coordinator`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cohortgate.coordinator.contract.diff import ManifestDiff, diff
from cohortgate.coordinator.contract.layout import Layout, LayoutBuilder, config_fingerprint, layout
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest, ManifestError

if TYPE_CHECKING:
    from cohortgate.agent.cohort import Cohort, CohortRefused, init_process_group, join
    from cohortgate.agent.dtensor import dtensor_pieces
    from cohortgate.agent.identity import tokenizer_fingerprint
    from cohortgate.agent.signature import manifest
    from cohortgate.agent.torchrun import CohortgateError, CohortStalled, ReplicasDiverged

__all__ = [
    "Cohort",
    "CohortRefused",
    "CohortStalled",
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

# Loaded on first use: importing cohortgate must not pull in torch or grpc.
_LAZY = {
    "manifest": "cohortgate.agent.signature",
    "dtensor_pieces": "cohortgate.agent.dtensor",
    "join": "cohortgate.agent.cohort",
    "init_process_group": "cohortgate.agent.cohort",
    "Cohort": "cohortgate.agent.cohort",
    "CohortRefused": "cohortgate.agent.cohort",
    "CohortgateError": "cohortgate.agent.torchrun",
    "ReplicasDiverged": "cohortgate.agent.torchrun",
    "CohortStalled": "cohortgate.agent.torchrun",
    "tokenizer_fingerprint": "cohortgate.agent.identity",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'cohortgate' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
