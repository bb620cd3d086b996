"""What the coordinator tells the outside world as cohorts change: metrics. It only observes:
the verdict history is the service's (`Coordinator.history`), never reached through here."""

from __future__ import annotations

from collections.abc import Callable

from cohortgate.coordinator.service.metrics import Metrics
from cohortgate.coordinator.state.base import LiveCohort


class Observer:
    """Metrics, called by the service at each event."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = metrics or Metrics()
        # This replica's role and leader, for status (set where replicas run on etcd).
        self.replica: Callable[[], dict[str, str]] | None = None

    def history_failed(self, operation: str, _: Exception) -> None:
        self.metrics.history_errors.labels(operation).inc()

    def history_state(self, problem: str, spooled: int) -> None:
        self.metrics.history_degraded.set(1 if problem else 0)
        self.metrics.history_spooled.set(spooled)

    def joined(self, waiting: int, opened: bool, intruders: int = 0) -> None:
        """One call's joins: `waiting` ranks now wait (a new cohort if `opened`); intruders
        of another launch count as joins, never as waiting."""
        if waiting + intruders:
            self.metrics.joins.inc(waiting + intruders)
        if waiting:
            self.metrics.ranks_waiting.inc(waiting)
        if opened:
            self.metrics.cohorts_waiting.inc()

    def departed(self) -> None:
        self.metrics.departures.inc()
        self.metrics.ranks_waiting.dec()

    def abandoned(self) -> None:
        self.metrics.cohorts_waiting.dec()
        self.metrics.abandoned.inc()

    def uploaded(self, accepted: bool, size: int) -> None:
        self.metrics.manifest_uploads.labels("accepted" if accepted else "rejected").inc()
        self.metrics.manifest_bytes.inc(size)

    def decided(self, cohort: LiveCohort) -> None:
        """Count the verdict."""
        verdict = cohort.verdict
        assert verdict is not None
        m = self.metrics
        outcome = verdict.outcome.value
        cause = verdict.cause.value if verdict.cause else "none"
        m.verdicts.labels(outcome, cause).inc()
        m.formation_from_first_join.labels(outcome).observe(
            verdict.decided_at - cohort.state.first_join_at
        )
        if cohort.state.last_join_at:
            m.formation_from_last_join.labels(outcome).observe(
                max(verdict.decided_at - cohort.state.last_join_at, 0.0)
            )
        for finding in verdict.findings:
            m.findings.labels(finding.check, finding.level).inc()
        m.cohorts_waiting.dec()
        m.ranks_waiting.dec(len(cohort.state.members))

    def rpc_error(self, method: str, code: str) -> None:
        self.metrics.rpc_errors.labels(method, code).inc()
