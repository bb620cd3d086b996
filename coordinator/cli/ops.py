"""`cohortgate status | watch | explain`: what on-call types at 3 a.m."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.json_format import MessageToDict

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec.channel import ClientSecurity
from cohortgate.coordinator.codec.leader import addresses
from cohortgate.coordinator.codec.wire import STATE_NAMES
from cohortgate.coordinator.contract.addr import DEFAULT_ADDR
from cohortgate.coordinator.contract.errors import CoordinatorError
from cohortgate.coordinator.edge.replies import finding_to_pb, record_to_pb
from cohortgate.coordinator.state.base import VerdictStore


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    addr_help = (
        f"coordinator HOST:PORT, or its replicas a:7070,b:7070 (the leader is asked); default "
        f"$COHORTGATE_ADDR, else {DEFAULT_ADDR}"
    )
    token_help = "bearer token (default $COHORTGATE_TOKEN); TLS from $COHORTGATE_TLS_*"
    p = sub.add_parser("status", help="list cohorts (waiting and recently decided)")
    p.add_argument("job", nargs="?", default="", help="only this job")
    p.add_argument("--addr", help=addr_help)
    p.add_argument("--token", help=token_help)
    p.add_argument("--json", action="store_true", help="machine-readable output (default: a table)")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("watch", help="live progress of a job's cohort, then its verdict")
    p.add_argument("job", nargs="?", default="", help="only this job (default: every job)")
    p.add_argument("--addr", help=addr_help)
    p.add_argument("--token", help=token_help)
    p.add_argument(
        "--json", action="store_true", help="one JSON object per change (default: a live bar)"
    )
    p.set_defaults(func=cmd_watch)
    p = sub.add_parser("explain", help="the full report of a past verdict, from history")
    p.add_argument("job")
    p.add_argument("round", nargs="?", type=int, default=0, help="default: the latest")
    p.add_argument("--addr", help=addr_help)
    p.add_argument("--token", help=token_help)
    p.add_argument("--json", action="store_true", help="machine-readable output (default: a table)")
    p.add_argument(
        "--audits",
        action="store_true",
        help="the job's findings during training: replicas that diverged (step, ranks, "
        "hosts, tensors; cohort.audit), ranks that sent no audit in time, and stalls (which "
        "rank is where; cohort.step) (default: the verdict's report, then its stalls)",
    )
    p.add_argument(
        "--history",
        help="read this SQLite history file directly instead of asking a coordinator (default: "
        "ask; if none answers, read $COHORTGATE_HISTORY or "
        "~/.local/state/cohortgate/history.sqlite, where `cohortgate run` keeps its verdicts)",
    )
    p.add_argument(
        "--etcd",
        default=os.environ.get("COHORTGATE_ETCD", ""),
        help="read the verdict history of active/standby replicas from these etcd endpoints "
        "directly (default $COHORTGATE_ETCD; etcd TLS and user from $COHORTGATE_ETCD_*)",
    )
    p.add_argument(
        "--etcd-prefix",
        default=os.environ.get("COHORTGATE_ETCD_PREFIX", "/cohortgate/"),
        help="the fleet's key prefix (default $COHORTGATE_ETCD_PREFIX, else /cohortgate/)",
    )
    p.set_defaults(func=cmd_explain)


def _addr(args: argparse.Namespace) -> str:
    """The coordinator to ask; of active/standby replicas (a:7070,b:7070), the one that
    leads (its CohortService is SERVING), else the first that answers."""
    spec = str(args.addr or os.environ.get("COHORTGATE_ADDR") or DEFAULT_ADDR)
    # The agent's own parser: one clear line for "localhost" (no port) or a URL.
    replicas = addresses(spec, "--addr" if args.addr else "COHORTGATE_ADDR")
    if len(replicas) == 1:
        return replicas[0]
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    security = ClientSecurity.from_env(token=getattr(args, "token", None))
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


def _fail(addr: str, exc: grpc.RpcError) -> int:
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


def _say_unknown(addr: str, security: ClientSecurity, job: str) -> None:
    with security.channel(addr) as channel:
        hint = _unknown_job(pb_grpc.StatusServiceStub(channel), job, security.metadata)
    if hint:
        print(hint, file=sys.stderr)


def _dict(msg: Any) -> dict[str, Any]:
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


def cmd_status(args: argparse.Namespace) -> int:
    addr = _addr(args)
    security = ClientSecurity.from_env(token=args.token)
    with security.channel(addr) as channel:
        try:
            reply = pb_grpc.StatusServiceStub(channel).ListCohorts(
                pb.ListCohortsRequest(job_id=args.job), timeout=10, metadata=security.metadata
            )
        except grpc.RpcError as exc:
            return _fail(addr, exc)
    if args.json:
        print(json.dumps([_dict(c) for c in reply.cohorts], indent=1))
        return 0
    if not reply.cohorts:
        print("no cohorts" + (f" for job {args.job}" if args.job else ""))
        if args.job:
            _say_unknown(addr, security, args.job)
        return 0
    print(f"{'JOB':<24} {'ROUND':>5} {'STATE':<8} {'JOINED':>13} {'AGE':>8} REASON")
    for c in reply.cohorts:
        print(_row(c))
    return 0


def _bar(joined: int, expected: int, width: int = 30) -> str:
    filled = int(width * joined / max(expected, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def cmd_watch(args: argparse.Namespace) -> int:
    """Follow the watch stream; with a job, stop once its latest cohort is decided."""
    addr = _addr(args)
    tty = sys.stdout.isatty() and not args.json
    security = ClientSecurity.from_env(token=args.token)
    with security.channel(addr) as channel:
        stub = pb_grpc.StatusServiceStub(channel)
        try:
            if args.job and not _latest_round(stub, args.job, security.metadata):
                print(
                    f"no cohort of job {args.job} on {addr} yet: waiting for its first rank "
                    "to join (Ctrl-C to stop)",
                    file=sys.stderr,
                    flush=True,
                )
                _say_unknown(addr, security, args.job)
            for s in stub.WatchCohorts(
                pb.WatchCohortsRequest(job_id=args.job), metadata=security.metadata
            ):
                state = STATE_NAMES.get(s.state, "?")
                if args.json:
                    print(json.dumps(_dict(s)), flush=True)
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
                    args.job
                    and state != "waiting"
                    and s.job_id == args.job
                    and _latest(stub, args.job, s.round, security.metadata)
                ):
                    if tty:
                        print()
                    print(f"verdict: {state} {s.reason}", flush=True)
                    if state in ("refused", "expired"):
                        _print_report(stub, args.job, s.round, security.metadata)
                    return 0 if state == "formed" else 3
        except grpc.RpcError as exc:
            return _fail(addr, exc)
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


_T = TypeVar("_T")


def _from_file(path: str, read: Callable[[VerdictStore], _T]) -> _T:
    """`read` of the history file (OSError or CoordinatorError (UNAVAILABLE) when the file
    cannot be read)."""
    from cohortgate.coordinator.state.backends import open_verdicts

    history = open_verdicts(path, readonly=True)
    try:
        return read(history)
    finally:
        history.close()


def _from_etcd(args: argparse.Namespace, read: Callable[[VerdictStore], _T]) -> _T:
    """`read` of the history in etcd, as any replica reads it (OSError when etcd cannot be
    read)."""
    from cohortgate.coordinator.edge.config import ServeConfig, from_env_and_flags
    from cohortgate.coordinator.etcd.client import EtcdThread
    from cohortgate.coordinator.state.backends import open_etcd_verdicts

    flags = {"etcd": args.etcd, "etcd_prefix": args.etcd_prefix, "history": "off"}
    settings = from_env_and_flags(ServeConfig, flags).etcd_settings
    assert settings is not None
    etcd = EtcdThread(settings)
    try:
        history = open_etcd_verdicts(
            etcd, 36500, token=lambda: 0, lost=lambda why: None, readonly=True
        )
        return read(history)
    finally:
        etcd.close()


def _verdict(job: str, round_: int) -> Callable[[VerdictStore], pb.VerdictRecord | None]:
    def read(history: VerdictStore) -> pb.VerdictRecord | None:
        row = history.get(job, round_)
        return None if row is None else record_to_pb(row)

    return read


def _audit_records(job: str) -> Callable[[VerdictStore], list[pb.AuditRecord]]:
    return lambda history: [finding_to_pb(f) for f in history.audits(job)]


def _explain_from(
    where: str, read: Callable[[], pb.VerdictRecord | None], args: argparse.Namespace
) -> pb.VerdictRecord | int:
    """The verdict `read()` finds (a history file, etcd), or 1 with what went wrong."""
    try:
        record = read()
    except (OSError, ValueError, CoordinatorError) as exc:
        print(f"cohortgate: cannot read the verdict history in {where}: {exc}", file=sys.stderr)
        return 1
    if record is None:
        which = f"round {args.round} of job {args.job!r}" if args.round else f"job {args.job!r}"
        print(f"cohortgate: no verdict of {which} in {where}", file=sys.stderr)
        return 1
    return record


def _explain_file(path: str, args: argparse.Namespace) -> pb.VerdictRecord | int:
    return _explain_from(path, lambda: _from_file(path, _verdict(args.job, args.round)), args)


def _explain_etcd(args: argparse.Namespace) -> pb.VerdictRecord | int:
    return _explain_from(
        f"etcd {args.etcd}", lambda: _from_etcd(args, _verdict(args.job, args.round)), args
    )


def _explain_from_files(
    addr: str, args: argparse.Namespace, exc: grpc.RpcError
) -> pb.VerdictRecord | int:
    """No coordinator answers (or it does not hold the job): the history files on this
    machine, the shared one and the one `cohortgate run` kept for this job."""
    files = _local_histories(args.job)
    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND) or not files:
        return _fail_unknown(addr, args, exc)
    for path in files:
        if exc.code() is grpc.StatusCode.UNAVAILABLE:
            print(f"cohortgate: no coordinator answers at {addr}; reading {path}", file=sys.stderr)
        try:
            found = _from_file(str(path), _verdict(args.job, args.round))
        except (OSError, CoordinatorError):  # a file that cannot be read: try the next one
            continue
        if found is not None:
            return found
    return _fail_unknown(addr, args, exc)


# Run histories read at most, newest first, looking for a job that none of its own names.
RUNS_READ = 50


def _local_histories(job: str) -> list[Path]:
    """The history files on this machine: the shared one, the one `cohortgate run` kept for
    the job, then the other runs' (the demo's, a run whose job id was generated), newest
    first."""
    from cohortgate.coordinator.edge.config import DEFAULT_HISTORY, run_history, runs_dir

    shared = Path(os.environ.get("COHORTGATE_HISTORY") or DEFAULT_HISTORY).expanduser()
    own = run_history(job)
    try:
        others = sorted(runs_dir().glob("*.sqlite"), key=lambda p: -p.stat().st_mtime)
    except OSError:
        others = []
    found = [shared, own, *(p for p in others[:RUNS_READ] if p != own)]
    return [f for f in found if f.is_file()]


def _fail_unknown(addr: str, args: argparse.Namespace, exc: grpc.RpcError) -> int:
    code = _fail(addr, exc)
    if exc.code() is grpc.StatusCode.NOT_FOUND:
        _say_unknown(addr, ClientSecurity.from_env(token=args.token), args.job)
    return code


def cmd_explain(args: argparse.Namespace) -> int:
    if args.audits:
        return _explain_audits(args)
    addr = _addr(args)
    record: pb.VerdictRecord | int
    if args.history:
        record = _explain_file(args.history, args)
    elif args.etcd:
        record = _explain_etcd(args)
    else:
        security = ClientSecurity.from_env(token=args.token)
        with security.channel(addr) as channel:
            try:
                record = pb_grpc.StatusServiceStub(channel).GetVerdict(
                    pb.GetVerdictRequest(job_id=args.job, round=args.round),
                    timeout=10,
                    metadata=security.metadata,
                )
            except grpc.RpcError as exc:
                record = _explain_from_files(addr, args, exc)
    if isinstance(record, int):
        return record
    stalls = [r for r in _quiet_records(args) if r.cohort_id == record.cohort_id]
    stalls = [r for r in stalls if r.kind in STALL_KINDS]
    if args.json:
        out = _dict(record)
        out["stalls"] = [{**_dict(r), "step": r.step} for r in stalls]
        print(json.dumps(out, indent=1))
        return 0
    decided = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.decided_at_unix))
    print(f"job {record.job_id} round {record.round}: {record.outcome} at {decided}Z")
    print(f"cohort {record.cohort_id}, world size {record.world_size}")
    print(f"reason: {record.reason}")
    if record.report:
        print()
        print(record.report)
    _print_stalls(stalls)
    return 0


# Audit records that are stalls during training (service/stalls.py), not audits.
STALL_KINDS = ("stalled", "resumed")


def _print_stalls(records: Sequence[pb.AuditRecord], listed: bool = False) -> None:
    """Each stall and its end, one line each (unless `listed` already), then the report of
    the last stall (said to be going on when no "resumed" came after it)."""
    if not records:
        return
    if not listed:
        print()
    for r in records if not listed else ():
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.at_unix))
        print(f"{at}Z {r.kind} ({r.level}): {r.headline}")
    last = next((r for r in reversed(records) if r.kind == "stalled"), None)
    if last is not None:
        going_on = records[-1] is last
        print()
        print(f"the stall{' (still going on)' if going_on else ''}: {last.headline}")
        print(last.report)


def _quiet_records(args: argparse.Namespace) -> list[pb.AuditRecord]:
    """The job's audit records from where the verdict came, or none (never an error: the
    verdict is the answer; these add to it)."""
    try:
        if args.history:
            return _from_file(args.history, _audit_records(args.job))
        if args.etcd:
            return _from_etcd(args, _audit_records(args.job))
        security = ClientSecurity.from_env(token=args.token)
        with security.channel(_addr(args)) as channel:
            reply = pb_grpc.StatusServiceStub(channel).ListAudits(
                pb.ListAuditsRequest(job_id=args.job), timeout=10, metadata=security.metadata
            )
            return list(reply.audits)
    except (OSError, ValueError, CoordinatorError, grpc.RpcError):
        return []


def _explain_audits(args: argparse.Namespace) -> int:
    """`explain JOB --audits`: from --history, --etcd, or the coordinator (its history),
    falling back to the history files on this machine when none answers."""
    records: list[pb.AuditRecord] | None = None
    where = ""
    try:
        if args.history:
            where, records = args.history, _from_file(args.history, _audit_records(args.job))
        elif args.etcd:
            where = f"etcd {args.etcd}"
            records = _from_etcd(args, _audit_records(args.job))
        else:
            records = _audits_asked(args)
    except (OSError, ValueError, CoordinatorError) as exc:
        print(f"cohortgate: cannot read the audit history in {where}: {exc}", file=sys.stderr)
        return 1
    if records is None:
        return 1
    if args.json:
        # steps as numbers (protobuf's JSON writes 64-bit integers as strings)
        rows = [{**_dict(r), "step": r.step, "stop_step": r.stop_step} for r in records]
        print(json.dumps(rows, indent=1))
        return 0
    if not records:
        print(
            f"job {args.job}: no audit finding: every audited step agreed, or the job never "
            "called cohort.audit(model, step)"
        )
        return 0
    for r in records:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r.at_unix))
        stop = f", stopped at step {r.stop_step}" if r.stop_step else ""
        print(f"{at}Z step {r.step}: {r.kind} ({r.level}{stop}): {r.headline}")
    last = next((r for r in reversed(records) if r.kind == "diverged"), None)
    if last is not None:
        print()
        print(last.report)
    _print_stalls([r for r in records if r.kind in STALL_KINDS], listed=True)
    return 0


def _audits_asked(args: argparse.Namespace) -> list[pb.AuditRecord] | None:
    """The coordinator's answer to ListAudits; with none answering, this machine's history
    files (the shared one, and the one `cohortgate run` kept for the job)."""
    addr = _addr(args)
    security = ClientSecurity.from_env(token=args.token)
    with security.channel(addr) as channel:
        try:
            reply = pb_grpc.StatusServiceStub(channel).ListAudits(
                pb.ListAuditsRequest(job_id=args.job), timeout=10, metadata=security.metadata
            )
            return list(reply.audits)
        except grpc.RpcError as exc:
            error = exc
    files = _local_histories(args.job)
    if error.code() is not grpc.StatusCode.UNAVAILABLE or not files:
        _fail(addr, error)
        return None
    found: list[pb.AuditRecord] = []
    for path in files:
        print(f"cohortgate: no coordinator answers at {addr}; reading {path}", file=sys.stderr)
        try:
            found.extend(_from_file(str(path), _audit_records(args.job)))
        except (OSError, CoordinatorError):  # a file that cannot be read: the next one
            continue
    return sorted(found, key=lambda r: r.at_unix)
