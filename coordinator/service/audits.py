"""Audits during training, on the event loop: each call adds its ranks' audits to their
cohort's state (decision/audit.py) and answers at once; a timer (service/sweeper.py)
compares the steps some rank has not sent within --audit-timeout when their time comes.
Findings are logged, counted and kept in the history; a cohort's audit state lives by its id
while the job audits (beyond --job-retention), and a restarted coordinator re-establishes it
from the audits themselves and from the findings in the history.

Cheap per call: a dict insert per rank, a comparison per step once its last rank is in."""

from __future__ import annotations

from collections.abc import Callable

import structlog

from cohortgate.coordinator.contract.errors import (
    CoordinatorError,
    InvalidArgument,
)
from cohortgate.coordinator.decision.audit import Answer, CohortAudits, RankAudit
from cohortgate.coordinator.decision.formation import FormationOptions
from cohortgate.coordinator.decision.verdict import AuditFinding, Level
from cohortgate.coordinator.service.observers import Observer
from cohortgate.coordinator.service.sweeper import Sweeper
from cohortgate.coordinator.service.watched import Formed, Watched
from cohortgate.coordinator.state.base import VerdictStore

log = structlog.get_logger("cohortgate")

SWEEP_S = 1.0  # the upkeep (eviction) at most this far apart
# A cohort nobody audited for this long is forgotten (its findings stay in the history).
IDLE_S = 6 * 3600.0
MAX_AUDITED = 10_000  # cohorts audited at once


class Audits:
    def __init__(
        self,
        options: FormationOptions,
        history: VerdictStore,
        observer: Observer,
        clock: Callable[[], float],
        formed: Formed | None = None,
    ) -> None:
        self.options, self.history, self.observer, self.clock = options, history, observer, clock
        self.watched = Watched[CohortAudits](
            limit=MAX_AUDITED,
            room_idle_s=IDLE_S / 6,
            formed=formed,
            noun="audit",
            participle="audited",
            sized=observer.metrics.audited_cohorts.set,
        )
        self.cohorts = self.watched.cohorts
        self.due = self.watched.due
        self.sweeper = Sweeper(
            "audit", SWEEP_S, self.sweep, lambda: bool(self.cohorts), self.due, clock
        )

    # -- calls -----------------------------------------------------------------------------
    def submit(self, audits: list[RankAudit]) -> list[Answer]:
        """Add the audits (validated, one job); the answer for each cohort they name."""
        now = self.clock()
        touched: dict[str, CohortAudits] = {}
        for a in audits:
            c = touched.get(a.cohort_id) or self._cohort(a, now)
            touched[a.cohort_id] = c
            if c.level is not Level.OFF:
                c.add(a, now)
        self.observer.metrics.audits.inc(len(audits))
        self.observer.metrics.audit_calls.inc()
        timeout = self.options.audit_timeout_s
        for c in touched.values():
            self._drain(c)
            self.due.set(c.cohort_id, c.due(timeout))
        self.sweeper.start()
        return [c.answer() for c in touched.values()]

    def answer_for(self, cohort_id: str) -> Answer | None:
        """What the cohort's ranks are told now, for a call that carried no audit of it (a
        step mark): the same answer an audit gets, so no call clears what another said."""
        c = self.cohorts.get(cohort_id)
        return None if c is None else c.answer()

    def _cohort(self, a: RankAudit, now: float) -> CohortAudits:
        c = self.cohorts.get(a.cohort_id)
        if c is not None and (c.job_id != a.job_id or c.world_size != a.world_size):
            raise InvalidArgument(
                f"cohort {a.cohort_id[:64]} is audited as job '{c.job_id[:64]}' of "
                f"{c.world_size} ranks; this audit says job '{a.job_id[:64]}' of "
                f"{a.world_size}"
            )

        def new(hosts: dict[int, str]) -> CohortAudits:
            level = self.options.policies.for_job(a.job_id)["audit"]
            made = CohortAudits(a.cohort_id, a.job_id, a.world_size, level)
            made.hosts.update(hosts)
            self._restore(made)
            return made

        return c or self.watched.take(a.cohort_id, a.job_id, a.round, now, new)

    def _restore(self, c: CohortAudits) -> None:
        """What the history holds of this cohort (a coordinator restarted, or a failover)."""
        try:
            found = self.history.audits(c.job_id)
        except CoordinatorError as exc:
            log.warning("audit findings could not be read; not restored", error=str(exc))
            return
        for f in found:
            if f.cohort_id == c.cohort_id:
                c.restore(f)
        c.new.clear()

    def _drain(self, c: CohortAudits) -> None:
        m = self.observer.metrics
        if c.compared:
            m.audited_steps.inc(c.compared)
            c.compared = 0
        for f in c.new:
            if f.kind == "diverged":
                m.divergence.labels(f.level).inc()
                log.warning(
                    "replicas diverged",
                    job=f.job_id[:64],
                    cohort=f.cohort_id,
                    step=f.step,
                    stop_step=f.stop_step,
                    headline=f.headline,
                    report=f.report,
                )
            else:
                m.audit_missing.inc()
                log.warning("audits missing", job=f.job_id[:64], step=f.step, headline=f.headline)
            self.history.record_audit(f)
        c.new.clear()

    # -- sweeping --------------------------------------------------------------------------
    def sweep(self) -> None:
        """The cohorts whose time came, and (`Watched.sweep`) those idle for IDLE_S."""
        now, timeout = self.clock(), self.options.audit_timeout_s

        def look(c: CohortAudits) -> float | None:
            c.sweep(now, timeout)
            self._drain(c)
            return c.due(timeout)

        self.watched.sweep(now, look, IDLE_S)

    def close(self) -> None:
        self.sweeper.close()

    # -- reading ---------------------------------------------------------------------------
    def findings(self, job_id: str) -> list[AuditFinding]:
        """The job's findings, oldest first, from the history."""
        return self.history.audits(job_id)

    def status(self, shown: int = 100) -> list[dict[str, object]]:
        """One line per audited cohort, for /status.json and the status page: those with a
        divergence first, then those missing ranks, then the most recently audited."""
        ordered = sorted(
            self.cohorts.values(),
            key=lambda c: (not c.diverged_step, not c.missing, -c.last_seen),
        )
        out = []
        for c in ordered[:shown]:
            out.append(
                {
                    "job_id": c.job_id,
                    "cohort_id": c.cohort_id,
                    "level": str(c.level),
                    "ranks": c.world_size,
                    "last_step": c.last_step,
                    "last_compared": c.last_compared,
                    "diverged_step": c.diverged_step,
                    "stop_step": c.stop_step,
                    "headline": c.headline,
                    "missing": list(c.missing[:64]),
                }
            )
        return out
