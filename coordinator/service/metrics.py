"""Prometheus collectors: prefix cohortgate_, base units, bounded labels (never a rank or job)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Formation spans from sub-second (small jobs) to the 600 s default deadline.
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    """Every collector the coordinator exports, on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.joins = Counter(
            "cohortgate_joins_total",
            "Joins accepted (a rank entering a waiting cohort).",
            registry=r,
        )
        self.verdicts = Counter(
            "cohortgate_verdicts_total",
            "Verdicts by outcome and cause.",
            ["outcome", "cause"],
            registry=r,
        )
        self.formation_from_first_join = Histogram(
            "cohortgate_formation_from_first_join_seconds",
            "Seconds from a cohort's first join to its verdict.",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.formation_from_last_join = Histogram(
            "cohortgate_formation_from_last_join_seconds",
            "Seconds from a cohort's last join to its verdict (the gate's own cost).",
            ["outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cohorts_waiting = Gauge(
            "cohortgate_cohorts_waiting", "Cohorts waiting for ranks or manifests.", registry=r
        )
        self.ranks_waiting = Gauge(
            "cohortgate_ranks_waiting",
            "Ranks holding a join open, waiting for a verdict.",
            registry=r,
        )
        self.oldest_waiting = Gauge(
            "cohortgate_oldest_waiting_cohort_age_seconds",
            "Age of the oldest waiting cohort (0 when none waits).",
            registry=r,
        )
        self.manifest_uploads = Counter(
            "cohortgate_manifest_uploads_total",
            "Manifest uploads by result.",
            ["result"],
            registry=r,
        )
        self.manifest_bytes = Counter(
            "cohortgate_manifest_upload_bytes_total", "Bytes of manifests uploaded.", registry=r
        )
        self.rpc_errors = Counter(
            "cohortgate_rpc_errors_total",
            "RPCs ended with an error, by method and status code.",
            ["method", "code"],
            registry=r,
        )
        self.findings = Counter(
            "cohortgate_check_findings_total",
            "Differences found by the layered checks, by check and policy level.",
            ["check", "level"],
            registry=r,
        )
        self.departures = Counter(
            "cohortgate_rank_departures_total",
            "Ranks whose join dropped before the verdict.",
            registry=r,
        )
        self.abandoned = Counter(
            "cohortgate_cohorts_abandoned_total",
            "Waiting cohorts whose every rank left before a verdict (never a refusal).",
            registry=r,
        )

        self.offloaded = Counter(
            "cohortgate_decisions_offloaded_total",
            "Decisions made in a worker thread (large layouts or diffs), off the event loop.",
            registry=r,
        )
        self.history_errors = Counter(
            "cohortgate_history_errors_total",
            "Verdict history operations that failed (locked, full or unreadable file), by "
            "operation; verdicts are still sent to every rank.",
            ["operation"],
            registry=r,
        )
        self.history_spooled = Gauge(
            "cohortgate_history_spooled_verdicts",
            "Verdicts decided but not yet written to the history file.",
            registry=r,
        )
        self.history_degraded = Gauge(
            "cohortgate_history_degraded",
            "1 while the history file refuses writes (the coordinator keeps serving).",
            registry=r,
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
