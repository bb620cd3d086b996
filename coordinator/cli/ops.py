"""`cohortgate status | watch` (and `explain`, cli/explain.py): what on-call types at 3 a.m."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.cli.flags import add_flags
from cohortgate.coordinator.cli.ops_settings import (
    ClientSettings,
    ExplainSettings,
    StatusSettings,
    WatchSettings,
)
from cohortgate.coordinator.codec.channel import ClientSecurity
from cohortgate.coordinator.codec.leader import addresses
from cohortgate.coordinator.codec.wire import STATE_NAMES


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """status, watch and explain: each a settings model's flags (cli/ops_settings.py)."""
    from cohortgate.coordinator.cli.explain import cmd_explain

    commands: list[tuple[str, str, type[ClientSettings], Callable[[Any], int]]] = [
        ("status", "list cohorts (waiting and recently decided)", StatusSettings, cmd_status),
        ("watch", "live progress of a job's cohort, then its verdict", WatchSettings, cmd_watch),
        (
            "explain",
            "the full report of a past verdict, from history",
            ExplainSettings,
            cmd_explain,
        ),
    ]
    for name, said, model, run in commands:
        p = sub.add_parser(
            name,
            help=said,
            description=f"{said[0].upper()}{said[1:]}. Every flag can also be set as a "
            "COHORTGATE_<NAME> variable; a flag wins over its variable.",
        )
        add_flags(p, model)
        p.set_defaults(func=run, model=model)


def address_of(s: ClientSettings) -> str:
    """The coordinator to ask; of active/standby replicas (a:7070,b:7070), the one that
    leads (its CohortService is SERVING), else the first that answers."""
    replicas = addresses(s.addr, "--addr")  # checked as the settings were read
    if len(replicas) == 1:
        return replicas[0]
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    security = security_of(s)
    answered = []
    for addr in replicas:
        with security.channel(addr) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="cohortgate.v1.CohortService"),
                    timeout=2,
                    metadata=security.metadata,
                )
            except grpc.RpcError:
                continue
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return addr
        answered.append(addr)
    return (answered or replicas)[0]


def say_failure(addr: str, exc: grpc.RpcError) -> int:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        print(
            f"cohortgate: no coordinator answers at {addr} ({exc.details()}); "
            "pass --addr HOST:PORT or set COHORTGATE_ADDR (explain also reads --history FILE)",
            file=sys.stderr,
        )
    else:
        print(f"cohortgate: {code.name}: {exc.details()}", file=sys.stderr)
    return 1


_GENERATED = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}|run-[0-9a-f]{12}"
)


def _unknown_job(
    stub: pb_grpc.StatusServiceStub, job: str, metadata: Sequence[tuple[str, str]]
) -> str:
    """Why a job may be missing: the recent jobs whose ids torchrun (or cohortgate run)
    generated, when there are any."""
    try:
        reply = stub.ListCohorts(pb.ListCohortsRequest(), timeout=10, metadata=metadata)
    except grpc.RpcError:
        return ""
    recent = sorted(
        {c.job_id for c in reply.cohorts if _GENERATED.fullmatch(c.job_id)},
        key=lambda j: -max(c.first_join_unix for c in reply.cohorts if c.job_id == j),
    )
    if not recent:
        return ""
    shown = ", ".join(recent[:5]) + (f" (and {len(recent) - 5} more)" if len(recent) > 5 else "")
    return (
        f"recent jobs with generated ids: {shown}. A one-node torchrun with no "
        "--rdzv-endpoint and no --master-port replaces --rdzv-id with a random id; set "
        f"COHORTGATE_JOB={job} (or pass --master-port) to keep yours"
    )


def security_of(s: ClientSettings) -> ClientSecurity:
    return ClientSecurity.from_env(token=s.token or None)


def say_unknown(addr: str, security: ClientSecurity, job: str) -> None:
    with security.channel(addr) as channel:
        hint = _unknown_job(pb_grpc.StatusServiceStub(channel), job, security.metadata)
    if hint:
        print(hint, file=sys.stderr)


def as_dict(msg: Any) -> dict[str, Any]:
    return MessageToDict(
        msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _row(s: pb.CohortSummary) -> str:
    state = STATE_NAMES.get(s.state, "?")
    missing = f" missing {s.missing_ranks}" if s.missing_ranks else ""
    return (
        f"{s.job_id:<24} {s.round:>5} {state:<8} {s.joined:>6}/{s.expected:<6} "
        f"{s.age_seconds:>7.0f}s {s.reason}{missing}"
    )


def cmd_status(s: StatusSettings) -> int:
    addr = address_of(s)
    security = security_of(s)
    with security.channel(addr) as channel:
        try:
            reply = pb_grpc.StatusServiceStub(channel).ListCohorts(
                pb.ListCohortsRequest(job_id=s.job), timeout=10, metadata=security.metadata
            )
        except grpc.RpcError as exc:
            return say_failure(addr, exc)
    if s.json_out:
        print(json.dumps([as_dict(c) for c in reply.cohorts], indent=1))
        return 0
    if not reply.cohorts:
        print("no cohorts" + (f" for job {s.job}" if s.job else ""))
        if s.job:
            say_unknown(addr, security, s.job)
        return 0
    print(f"{'JOB':<24} {'ROUND':>5} {'STATE':<8} {'JOINED':>13} {'AGE':>8} REASON")
    for c in reply.cohorts:
        print(_row(c))
    return 0


def _bar(joined: int, expected: int, width: int = 30) -> str:
    filled = int(width * joined / max(expected, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def cmd_watch(cfg: WatchSettings) -> int:
    """Follow the watch stream; with a job, stop once its latest cohort is decided."""
    addr = address_of(cfg)
    tty = sys.stdout.isatty() and not cfg.json_out
    security = security_of(cfg)
    with security.channel(addr) as channel:
        stub = pb_grpc.StatusServiceStub(channel)
        try:
            if cfg.job and not _latest_round(stub, cfg.job, security.metadata):
                print(
                    f"no cohort of job {cfg.job} on {addr} yet: waiting for its first rank "
                    "to join (Ctrl-C to stop)",
                    file=sys.stderr,
                    flush=True,
                )
                say_unknown(addr, security, cfg.job)
            for s in stub.WatchCohorts(
                pb.WatchCohortsRequest(job_id=cfg.job), metadata=security.metadata
            ):
                state = STATE_NAMES.get(s.state, "?")
                if cfg.json_out:
                    print(json.dumps(as_dict(s)), flush=True)
                else:
                    line = (
                        f"{s.job_id} round {s.round} {_bar(s.joined, s.expected)} "
                        f"{s.joined}/{s.expected} {state}"
                        + (
                            f", waiting for ranks {s.missing_ranks}"
                            if s.missing_ranks and state == "waiting"
                            else ""
                        )
                    )
                    print(("\r\x1b[2K" if tty else "") + line, end="" if tty else "\n", flush=True)
                if (
                    cfg.job
                    and state != "waiting"
                    and s.job_id == cfg.job
                    and _latest(stub, cfg.job, s.round, security.metadata)
                ):
                    if tty:
                        print()
                    print(f"verdict: {state} {s.reason}", flush=True)
                    if state in ("refused", "expired"):
                        _print_report(stub, cfg.job, s.round, security.metadata)
                    return 0 if state == "formed" else 3
        except grpc.RpcError as exc:
            return say_failure(addr, exc)
        except KeyboardInterrupt:
            return 130
    return 0


def _latest_round(
    stub: pb_grpc.StatusServiceStub, job: str, metadata: Sequence[tuple[str, str]]
) -> int:
    reply = stub.ListCohorts(pb.ListCohortsRequest(job_id=job), timeout=10, metadata=metadata)
    return max((c.round for c in reply.cohorts), default=0)


def _latest(
    stub: pb_grpc.StatusServiceStub, job: str, round_: int, metadata: Sequence[tuple[str, str]]
) -> bool:
    return _latest_round(stub, job, metadata) <= round_


def _print_report(
    stub: pb_grpc.StatusServiceStub, job: str, round_: int, metadata: Sequence[tuple[str, str]]
) -> None:
    detail = stub.GetCohort(
        pb.GetCohortRequest(job_id=job, round=round_), timeout=10, metadata=metadata
    )
    if detail.verdict.refusal.report:
        print(detail.verdict.refusal.report)
