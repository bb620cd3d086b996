"""Which backend holds what: every caller opens its stores here, never a backend module.

Today: cohorts in memory (`MemoryStore`), verdicts in SQLite (`History`, a file path). A new
verdict backend (etcd, for active/standby coordinators) adds its spelling to
`open_verdicts` and passes tests/test_store_contract.py; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable

from coordinator.contract.limits import Limits
from coordinator.state.base import CohortStore, VerdictStore


def open_verdicts(
    spec: str, *, retention_days: float = 30.0, readonly: bool = False
) -> VerdictStore:
    """The verdict store `spec` names (a SQLite file path). Raises OSError with one line
    to print when it cannot be used."""
    from coordinator.state.history import History

    return History(spec, retention_days, readonly=readonly)


def open_cohorts(
    clock: Callable[[], float],
    verdicts: VerdictStore | None,
    limits: Limits | None = None,
) -> CohortStore:
    """Live cohorts, in the leading coordinator's memory; rounds continue from `verdicts`."""
    from coordinator.state.memory import MemoryStore

    return MemoryStore(clock, verdicts.last_round if verdicts is not None else lambda _: 0, limits)
