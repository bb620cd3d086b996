"""Coordinator settings: pydantic, filled from COHORTGATE_* variables, then flags (flags win)."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from coordinator.contract.addr import DEFAULT_ADDR, split_host_port
from coordinator.contract.limits import Limits
from coordinator.decision.checks import Policies, policy_help
from coordinator.decision.formation import FormationOptions
from coordinator.edge.exposure import check_tls_files, exposed, is_loopback

DEFAULT_METRICS_ADDR = "127.0.0.1:9470"
DEFAULT_HISTORY = "~/.local/state/cohortgate/history.sqlite"
ENV_PREFIX = "COHORTGATE_"


def run_history(job_id: str) -> Path:
    """The history file of the coordinator `cohortgate run` starts for one job: its own, so
    that no other coordinator's status lists its jobs; `cohortgate explain` looks here too."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job_id)[:80]
    tag = hashlib.sha256(job_id.encode()).hexdigest()[:8]
    return Path(DEFAULT_HISTORY).expanduser().parent / "runs" / f"{safe}-{tag}.sqlite"


class ServeConfig(BaseModel):
    """`cohortgate serve`: each field is also COHORTGATE_<FIELD> (upper case)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    listen: str = Field(DEFAULT_ADDR, description="gRPC address to listen on, HOST:PORT")
    allow_remote: bool = Field(
        False, description="allow listening on a non-loopback address (exposes the port)"
    )
    join_deadline: float = Field(600.0, gt=0, description="seconds from a cohort's first join")
    manifest_timeout: float = Field(30.0, gt=0, description="seconds to wait for manifests")
    progress_interval: float = Field(1.0, gt=0, description="seconds between progress events")
    watch_interval: float = Field(
        0.5,
        gt=0,
        description="a status watcher gets at most one update per job this often (and "
        "watchers never take more than an eighth of the coordinator's time)",
    )
    grace: float = Field(5.0, ge=0, description="seconds of graceful shutdown on SIGTERM")
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    port_file: Path | None = Field(
        None, description="once serving, write the gRPC port, then the metrics port, here"
    )
    metrics_listen: str = Field(
        DEFAULT_METRICS_ADDR,
        description="HTTP address for /metrics, /status and /status.json; 'off' disables",
    )
    history: str = Field(
        DEFAULT_HISTORY, description="SQLite file of past verdicts; 'off' keeps none"
    )
    history_retention_days: float = Field(30.0, gt=0, description="days a verdict is kept")
    job_retention: float = Field(
        600.0, gt=0, description="seconds a decided job stays in memory (history keeps it)"
    )
    rank_grace: float = Field(
        15.0, gt=0, description="seconds within which a dead rank's join is dropped"
    )
    tokens_file: Path | None = Field(
        None, description="bearer tokens, one 'TOKEN JOB_ID' (or 'TOKEN *') per line"
    )
    tls_cert: Path | None = Field(None, description="server certificate (PEM) for TLS")
    tls_key: Path | None = Field(None, description="server private key (PEM) for TLS")
    tls_client_ca: Path | None = Field(
        None, description="CA (PEM) that client certificates must chain to: mutual TLS"
    )
    policy: str = Field(
        "",
        description="check levels, comma-separated " + policy_help(),
    )
    job_policy: str = Field("", description="per-job check levels, 'JOB:CHECK=LEVEL,...'")
    max_message_bytes: int = Field(
        4 * 1024 * 1024,
        ge=512 * 1024,  # an upload's chunks (codec.wire.CHUNK_BYTES) must fit
        description="one gRPC message (joins; uploads larger than this travel in chunks)",
    )
    max_upload_bytes: int = Field(
        64 * 1024 * 1024, gt=0, description="one manifest or digest upload, all chunks"
    )
    max_world_size: int = Field(1 << 20, gt=0)
    max_manifest_entries: int = Field(1_000_000, gt=0)
    max_cohorts: int = Field(10_000, gt=0, description="waiting cohorts across all jobs")
    max_waiting_ranks: int = Field(2_000_000, gt=0, description="waiting ranks across all jobs")
    max_cohort_manifest_bytes: int = Field(
        256 * 1024 * 1024, gt=0, description="manifest bytes one forming cohort may hold"
    )
    max_manifest_bytes: int = Field(
        1024 * 1024 * 1024, gt=0, description="manifest bytes all forming cohorts may hold"
    )
    max_watchers: int = Field(1_000, gt=0, description="open WatchCohorts streams in all")
    max_watchers_per_token: int = Field(
        100, gt=0, description="open WatchCohorts streams per token (per job scope)"
    )

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        split_host_port(value)
        return value

    @field_validator("metrics_listen")
    @classmethod
    def _metrics_listen(cls, value: str) -> str:
        if value != "off":
            split_host_port(value)
        return value

    def check_exposure(self) -> None:
        for flag, addr in (("--listen", self.listen), ("--metrics-listen", self.metrics_listen)):
            if addr == "off":
                continue
            host, _ = split_host_port(addr)
            if not is_loopback(host) and not self.allow_remote:
                raise ValueError(
                    f"{flag} {addr} is not a loopback address; pass --allow-remote "
                    "(COHORTGATE_ALLOW_REMOTE=1) to serve other hosts"
                )
        http_remote = self.metrics_listen != "off" and not is_loopback(
            split_host_port(self.metrics_listen)[0]
        )
        if http_remote and self.tokens_file is not None and self.tls_cert is None:
            raise ValueError(
                f"--metrics-listen {self.metrics_listen} is not a loopback address and "
                "--tokens-file is set: the status page's admin token would cross the network "
                "in clear. Give --tls-cert and --tls-key (the HTTP port then serves HTTPS "
                "with them), or keep --metrics-listen on loopback"
            )

    @property
    def limits(self) -> Limits:
        return Limits(
            max_message_bytes=self.max_message_bytes,
            max_upload_bytes=self.max_upload_bytes,
            max_world_size=self.max_world_size,
            max_manifest_entries=self.max_manifest_entries,
            max_cohorts=self.max_cohorts,
            max_waiting_ranks=self.max_waiting_ranks,
            max_cohort_manifest_bytes=self.max_cohort_manifest_bytes,
            max_manifest_bytes=self.max_manifest_bytes,
            max_watchers=self.max_watchers,
            max_watchers_per_token=self.max_watchers_per_token,
        )

    def check_tls(self) -> None:
        check_tls_files("--tls", self.tls_cert, self.tls_key, self.tls_client_ca)

    @property
    def exposed(self) -> bool:
        """True when some port listens beyond loopback."""
        return any(exposed(addr) for addr in (self.listen, self.metrics_listen))

    @property
    def history_path(self) -> str | None:
        return None if self.history == "off" else str(Path(self.history).expanduser())

    @property
    def policies(self) -> Policies:
        split = [t for t in self.policy.split(",") if t.strip()]
        per_job = [t for t in self.job_policy.split(",") if t.strip()]
        return Policies.parse(split, per_job)

    @property
    def formation(self) -> FormationOptions:
        return FormationOptions(
            join_deadline_s=self.join_deadline,
            manifest_timeout_s=self.manifest_timeout,
            policies=self.policies,
        )


def from_env_and_flags(
    model: type[ServeConfig], flags: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> ServeConfig:
    """Environment first, then every flag the user actually gave (not None) on top."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for name in model.model_fields:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None and raw != "":
            values[name] = raw
    values.update({k: v for k, v in flags.items() if v is not None and k in model.model_fields})
    return model.model_validate(values)
