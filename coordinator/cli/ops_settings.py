"""Settings of `status`, `watch`, `explain` and `run`'s own options: models read as every
command's are (flags and COHORTGATE_* variables generated: edge/settings.py, cli/flags.py)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cohortgate.coordinator.contract.addr import DEFAULT_ADDR, split_host_port
from cohortgate.coordinator.edge.config import ServeConfig
from cohortgate.coordinator.edge.settings import ENV_PREFIX, POSITIONAL


class ClientSettings(BaseModel):
    """What every command that asks a coordinator takes. Its TLS files are
    COHORTGATE_TLS_* (a client's, as the agent's: codec/channel.py)."""

    env_prefix: ClassVar[str] = ENV_PREFIX
    model_config = ConfigDict(frozen=True, extra="forbid")

    addr: str = Field(
        DEFAULT_ADDR,
        description="coordinator HOST:PORT, or its replicas a:7070,b:7070 (the leader is asked)",
    )
    token: str = Field("", description="bearer token (TLS from $COHORTGATE_TLS_*)")
    json_out: bool = Field(
        False,
        description="machine-readable output (JSON) instead of text",
        json_schema_extra={"flag": "json", "env": "JSON"},
    )

    @field_validator("addr")
    @classmethod
    def _addr(cls, value: str) -> str:
        """Checked as the agent checks it: "localhost" (no port) or a URL is one clear line."""
        replicas = [a.strip() for a in value.split(",")]
        if not all(replicas):
            raise ValueError(f"{value!r} names an empty address; give HOST:PORT (or several)")
        for one in replicas:
            split_host_port(one)
        return value


class StatusSettings(ClientSettings):
    """`cohortgate status [JOB]`."""

    job: str = Field("", description="only this job", json_schema_extra=POSITIONAL)


class WatchSettings(ClientSettings):
    """`cohortgate watch [JOB]`: with a job, until its latest cohort is decided."""

    job: str = Field(
        "", description="only this job (default: every job)", json_schema_extra=POSITIONAL
    )


class ExplainSettings(ClientSettings):
    """`cohortgate explain JOB [ROUND]`: from the coordinator, a history file or etcd."""

    job: str = Field(description="the job", json_schema_extra=POSITIONAL)
    round: int = Field(0, ge=0, description="default: the latest", json_schema_extra=POSITIONAL)
    audits: bool = Field(
        False,
        description="the job's findings during training: replicas that diverged (step, ranks, "
        "hosts, tensors; cohort.audit), ranks that sent no audit in time, and stalls (which "
        "rank is where; cohort.step), instead of the verdict's report and its stalls",
    )
    history: str = Field(
        "",
        description="read this SQLite history file directly instead of asking a coordinator "
        "(without it: ask, and if none answers, read $COHORTGATE_HISTORY or "
        "~/.local/state/cohortgate/history.sqlite, where `cohortgate run` keeps its verdicts)",
        json_schema_extra={"env": "EXPLAIN_HISTORY"},
    )
    etcd: str = Field(
        "",
        description="read the verdict history of active/standby replicas from these etcd "
        "endpoints directly (etcd TLS and user from $COHORTGATE_ETCD_*)",
    )
    etcd_prefix: str = Field("/cohortgate/", description="the fleet's key prefix")


class RunSettings(BaseModel):
    """`cohortgate run`'s own options, taken off the front of its command line (the rest is
    torchrun's, passed on unchanged)."""

    env_prefix: ClassVar[str] = ENV_PREFIX + "RUN_"
    model_config = ConfigDict(frozen=True, extra="forbid")

    coordinator: str = Field(
        "",
        description="a coordinator every node reaches, HOST:PORT (the replicas of an "
        "active/standby coordinator as a list, a:7070,b:7070); without it one is started on "
        "this node, which only a single-node job can use",
    )
    no_relay: bool = Field(
        False,
        description="with --coordinator: workers join it directly (without it a relay is "
        "started on this node and they join through it, one call per node)",
    )
    join_deadline: float | None = Field(
        None,
        gt=0,
        description="the coordinator started here waits this many seconds for every rank "
        f"(without it: serve's default, {ServeConfig.model_fields['join_deadline'].default:g})",
        json_schema_extra={"env": "JOIN_DEADLINE"},
    )

    @field_validator("coordinator")
    @classmethod
    def _coordinator(cls, value: str) -> str:
        if value:
            ClientSettings._addr(value)
        return value
