"""Prometheus collectors: prefix cohortgate_, base units, bounded labels (never a rank or job)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Formation spans from sub-second (small jobs) to the 600 s default deadline.
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


PREFIX = "cohortgate_"


class Metrics:
    """Every collector the coordinator exports, on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        count, gauge, seconds = self._counter, self._gauge, self._latency
        self.joins = count("joins_total", "Joins accepted (a rank entering a waiting cohort).")
        self.verdicts = count(
            "verdicts_total", "Verdicts by outcome and cause.", "outcome", "cause"
        )
        self.formation_from_first_join = seconds(
            "formation_from_first_join_seconds",
            "Seconds from a cohort's first join to its verdict.",
        )
        self.formation_from_last_join = seconds(
            "formation_from_last_join_seconds",
            "Seconds from a cohort's last join to its verdict (the gate's own cost).",
        )
        self.cohorts_waiting = gauge("cohorts_waiting", "Cohorts waiting for ranks or manifests.")
        self.ranks_waiting = gauge(
            "ranks_waiting", "Ranks holding a join open, waiting for a verdict."
        )
        self.oldest_waiting = gauge(
            "oldest_waiting_cohort_age_seconds",
            "Age of the oldest waiting cohort (0 when none waits).",
        )
        self.manifest_uploads = count(
            "manifest_uploads_total", "Manifest uploads by result.", "result"
        )
        self.manifest_bytes = count("manifest_upload_bytes_total", "Bytes of manifests uploaded.")
        self.rpc_errors = count(
            "rpc_errors_total",
            "RPCs ended with an error, by method and status code.",
            "method",
            "code",
        )
        self.findings = count(
            "check_findings_total",
            "Differences found by the layered checks, by check and policy level.",
            "check",
            "level",
        )
        self.departures = count(
            "rank_departures_total", "Ranks whose join dropped before the verdict."
        )
        self.abandoned = count(
            "cohorts_abandoned_total",
            "Waiting cohorts whose every rank left before a verdict (never a refusal).",
        )
        self.offloaded = count(
            "decisions_offloaded_total",
            "Decisions made in a worker process (large layouts or diffs), off the event loop.",
        )
        self.history_errors = count(
            "history_errors_total",
            "Verdict history operations that failed (locked, full or unreadable file), by "
            "operation; verdicts are still sent to every rank.",
            "operation",
        )
        self.history_spooled = gauge(
            "history_spooled_verdicts",
            "Verdicts decided but not yet written to the history file.",
        )
        self.history_degraded = gauge(
            "history_degraded",
            "1 while the history file refuses writes (the coordinator keeps serving).",
        )
        self.leader = gauge(
            "leader",
            "1 while this replica leads (admits joins and delivers verdicts), 0 while it "
            "stands by (active/standby on etcd); always 1 for a single coordinator.",
        )
        self.leader.set(1)
        self.failovers = count(
            "leader_takeovers_total",
            "Times this replica took the lead (a failover to it, or its first lead).",
        )
        self.step_downs = count(
            "leader_step_downs_total",
            "Times this replica stopped leading, by why: lease (could not renew in time), "
            "fence (a fenced write failed: another leads), shutdown.",
            "why",
        )
        self.etcd_errors = count(
            "etcd_errors_total",
            "etcd calls that failed, by operation (leadership, write, read, prune).",
            "operation",
        )
        self.audits = count(
            "audits_total", "Rank audits received (cohort.audit(model, step), one per rank)."
        )
        self.audit_calls = count(
            "audit_calls_total",
            "Audit calls received: one per rank direct, one per node (or rack) through relays.",
        )
        self.audited_steps = count(
            "audited_steps_total", "Audited steps compared across their cohort's replicas."
        )
        self.divergence = count(
            "replica_divergence_total",
            "Divergences found by audits during training: replicas that must hold the same "
            "weights differ, by policy level (warn: reported; strict: the job is stopped).",
            "level",
        )
        self.audit_missing = count(
            "audit_missing_total",
            "Audited steps some ranks sent no audit for within --audit-timeout.",
        )
        self.audited_cohorts = gauge("audited_cohorts", "Formed cohorts whose audits are held.")
        self.stalls = count(
            "stalls_total",
            "Stalls found: formed cohorts no rank of which reached a new step within the stall "
            "bound (--stall-after), by policy level (strict: the job is ended).",
            "level",
        )
        self.stalled = gauge("stalled_cohorts", "Formed cohorts stalled now.")
        self.step_marks = count(
            "step_marks_total",
            "Step marks received (cohort.step, cohort.audit, and beats while a step lasts).",
        )
        self.stragglers = gauge(
            "stragglers",
            "Ranks whose steps take --straggler-ratio times their job's median or longer, "
            "across jobs (which ones: the status page).",
        )
        self.watched_cohorts = gauge(
            "watched_cohorts", "Formed cohorts whose ranks mark steps (stall detection)."
        )

    # Every name is prefixed cohortgate_; a counter's name ends in _total (the client
    # library's exposition adds it back).
    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(PREFIX + name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, registry=self.registry)

    def _latency(self, name: str, doc: str) -> Histogram:
        return Histogram(
            PREFIX + name, doc, ["outcome"], buckets=_LATENCY_BUCKETS, registry=self.registry
        )

    def names(self) -> set[str]:
        """Every series name this registry can export, whether or not it has samples yet
        (for checking that dashboards and alert rules use only real metrics)."""
        suffixes = {
            "counter": ("_total",),
            "gauge": ("",),
            "histogram": ("_bucket", "_count", "_sum"),
        }
        return {
            family.name + suffix
            for family in self.registry.collect()
            for suffix in suffixes.get(family.type, ("",))
        }
