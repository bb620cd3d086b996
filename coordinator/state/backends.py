"""Which backend holds what: every caller opens its stores here, never a backend module.

Live jobs in memory (`MemoryCohorts`, under the service's rules); verdicts in SQLite
(`History`, a file path), in etcd for active/standby replicas (`EtcdHistory`, serve --etcd),
or in memory (`MemoryHistory`, --history off). Every backend passes
tests/test_store_contract.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from cohortgate.coordinator.state.base import CohortData, VerdictStore

if TYPE_CHECKING:
    from cohortgate.coordinator.etcd.client import EtcdThread


def open_verdicts(
    spec: str | None, *, retention_days: float = 30.0, readonly: bool = False
) -> VerdictStore:
    """The verdict store `spec` names (a SQLite file path; None: this process's memory).
    Raises OSError with one line to print when it cannot be used."""
    if spec is None:
        from cohortgate.coordinator.state.memory_history import MemoryHistory

        return MemoryHistory(retention_days)
    from cohortgate.coordinator.state.history import History

    return History(spec, retention_days, readonly=readonly)


def open_cohort_data() -> CohortData:
    """Where the live jobs are kept: the leading coordinator's memory."""
    from cohortgate.coordinator.state.memory import MemoryCohorts

    return MemoryCohorts()


def open_etcd_verdicts(
    etcd: EtcdThread,
    retention_days: float,
    *,
    token: Callable[[], int],
    lost: Callable[[str], None],
    readonly: bool = False,
) -> VerdictStore:
    """The verdict history in etcd (serve --etcd): writes fenced by `token()`, the leader
    key's create revision while this replica leads; `lost(why)` steps it down when a fenced
    write fails. Raises OSError with one line to print when etcd cannot be read."""
    from cohortgate.coordinator.state.etcd_history import EtcdHistory

    return EtcdHistory(etcd, retention_days, token=token, lost=lost, readonly=readonly)
