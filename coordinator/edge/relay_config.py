"""Settings of `cohortgate relay` (read as every command's: edge/settings.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cohortgate.coordinator.contract.addr import split_host_port
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.edge.exposure import ServerTLS
from cohortgate.coordinator.edge.settings import ENV_PREFIX, LOG_FORMAT


def _local_ranks() -> int:
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "8"))
    except ValueError:
        return 8


class RelayConfig(BaseModel):
    """`cohortgate relay`: each field is also COHORTGATE_RELAY_<FIELD> (upper case). Its TLS
    is its own port's (what its ranks connect to); its upstream client TLS and token are
    COHORTGATE_TLS_* and COHORTGATE_TOKEN, as every client's (codec.channel)."""

    env_prefix: ClassVar[str] = ENV_PREFIX + "RELAY_"
    model_config = ConfigDict(frozen=True, extra="forbid")

    upstream: str = Field(
        description="the coordinator (or a rack relay), HOST:PORT; the replicas of an "
        "active/standby coordinator as a list, a:7070,b:7070 (the leader is followed)"
    )
    listen: str = Field("127.0.0.1:29471", description="HOST:PORT the node's ranks join")
    local_ranks: int = Field(
        default_factory=_local_ranks,
        ge=1,
        description="send the group upstream once this many ranks joined, directly or "
        "through relays below ($LOCAL_WORLD_SIZE or 8)",
    )
    window: float = Field(
        2.0,
        ge=0,
        description="or this many seconds after the first rank joined (a late local rank is "
        "sent on its own at once)",
    )
    audit_window: float = Field(
        0.05,
        gt=0,
        le=5.0,
        description="audits (cohort.audit) go upstream as one call once --local-ranks of "
        "them are in, or this many seconds after the first (DDP keeps a node's ranks within "
        "milliseconds; training never waits on it)",
    )
    tls_cert: Path | None = Field(
        None, description="the relay's server certificate (PEM) for TLS on its own port"
    )
    tls_key: Path | None = Field(None, description="its private key (PEM)")
    tls_client_ca: Path | None = Field(
        None, description="require client certificates from this CA (PEM): mutual TLS"
    )
    rank_grace: float | None = Field(
        None,
        gt=0,
        description="seconds within which a dead or frozen rank's join is dropped (its group "
        "re-joins without it), and within which a coordinator that stops answering is "
        "noticed (at least 5 s) and re-joined (default: the upstream's own --rank-grace, "
        "asked at start and every 30 s; 15 if it cannot say)",
    )
    settings_every: float = Field(
        30.0,
        gt=0,
        description="without --rank-grace: how often the upstream is asked for its grace (a "
        "change restarts the relay's server with it)",
    )
    max_message_bytes: int = Field(
        Limits.max_message_bytes,
        ge=512 * 1024,
        description="the largest join taken, and the most one upstream group may carry: the "
        "coordinator's own --max-message-bytes",
    )
    upstream_rpc: Literal["stream", "poll"] = Field(
        "stream",
        description="how groups join upstream: one JoinGroup stream each, or JoinPoll, a "
        "call per answer (11%% less coordinator CPU at 4,096 ranks, 40%% more at 16,384: "
        "README, Performance); poll falls back to stream against a coordinator of 0.2",
    )
    port_file: Path | None = Field(None, description="once serving, write the port here")
    log_format: Literal["auto", "json", "console"] = Field("auto", description=LOG_FORMAT)
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="")

    @field_validator("upstream", "listen")
    @classmethod
    def _addr(cls, value: str, info: ValidationInfo) -> str:
        for one in value.split(",") if info.field_name == "upstream" else (value,):
            split_host_port(one.strip())
        return value

    @model_validator(mode="after")
    def _checked(self) -> RelayConfig:
        self.tls.check()
        return self

    @property
    def tls(self) -> ServerTLS:
        return ServerTLS(self.tls_cert, self.tls_key, self.tls_client_ca)
