"""`cohortgate explain JOB [ROUND]`: the full report of a past verdict (and with --audits,
the job's findings during training), from the coordinator, a history file or etcd."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import grpc

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.cli.ops import (
    address_of,
    as_dict,
    say_failure,
    say_unknown,
    security_of,
)
from cohortgate.coordinator.cli.ops_settings import ExplainSettings
from cohortgate.coordinator.contract.errors import CoordinatorError
from cohortgate.coordinator.edge.replies import finding_to_pb, record_to_pb
from cohortgate.coordinator.state.base import VerdictStore

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


def _from_etcd(s: ExplainSettings, read: Callable[[VerdictStore], _T]) -> _T:
    """`read` of the history in etcd, as any replica reads it (OSError when etcd cannot be
    read)."""
    from cohortgate.coordinator.edge.config import ServeConfig
    from cohortgate.coordinator.edge.settings import from_env_and_flags
    from cohortgate.coordinator.etcd.client import EtcdThread
    from cohortgate.coordinator.state.backends import open_etcd_verdicts

    flags = {"etcd": s.etcd, "etcd_prefix": s.etcd_prefix, "history": "off"}
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
    where: str, read: Callable[[], pb.VerdictRecord | None], s: ExplainSettings
) -> pb.VerdictRecord | int:
    """The verdict `read()` finds (a history file, etcd), or 1 with what went wrong."""
    try:
        record = read()
    except (OSError, ValueError, CoordinatorError) as exc:
        print(f"cohortgate: cannot read the verdict history in {where}: {exc}", file=sys.stderr)
        return 1
    if record is None:
        which = f"round {s.round} of job {s.job!r}" if s.round else f"job {s.job!r}"
        print(f"cohortgate: no verdict of {which} in {where}", file=sys.stderr)
        return 1
    return record


def _explain_file(path: str, s: ExplainSettings) -> pb.VerdictRecord | int:
    return _explain_from(path, lambda: _from_file(path, _verdict(s.job, s.round)), s)


def _explain_etcd(s: ExplainSettings) -> pb.VerdictRecord | int:
    return _explain_from(f"etcd {s.etcd}", lambda: _from_etcd(s, _verdict(s.job, s.round)), s)


def _explain_from_files(
    addr: str, s: ExplainSettings, exc: grpc.RpcError
) -> pb.VerdictRecord | int:
    """No coordinator answers (or it does not hold the job): the history files on this
    machine, the shared one and the one `cohortgate run` kept for this job."""
    files = _local_histories(s.job)
    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND) or not files:
        return _fail_unknown(addr, s, exc)
    for path in files:
        if exc.code() is grpc.StatusCode.UNAVAILABLE:
            print(f"cohortgate: no coordinator answers at {addr}; reading {path}", file=sys.stderr)
        try:
            found = _from_file(str(path), _verdict(s.job, s.round))
        except (OSError, CoordinatorError):  # a file that cannot be read: try the next one
            continue
        if found is not None:
            return found
    return _fail_unknown(addr, s, exc)


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


def _fail_unknown(addr: str, s: ExplainSettings, exc: grpc.RpcError) -> int:
    code = say_failure(addr, exc)
    if exc.code() is grpc.StatusCode.NOT_FOUND:
        say_unknown(addr, security_of(s), s.job)
    return code


def cmd_explain(s: ExplainSettings) -> int:
    if s.audits:
        return _explain_audits(s)
    addr = address_of(s)
    record: pb.VerdictRecord | int
    if s.history:
        record = _explain_file(s.history, s)
    elif s.etcd:
        record = _explain_etcd(s)
    else:
        security = security_of(s)
        with security.channel(addr) as channel:
            try:
                record = pb_grpc.StatusServiceStub(channel).GetVerdict(
                    pb.GetVerdictRequest(job_id=s.job, round=s.round),
                    timeout=10,
                    metadata=security.metadata,
                )
            except grpc.RpcError as exc:
                record = _explain_from_files(addr, s, exc)
    if isinstance(record, int):
        return record
    stalls = [r for r in _quiet_records(s) if r.cohort_id == record.cohort_id]
    stalls = [r for r in stalls if r.kind in STALL_KINDS]
    if s.json_out:
        out = as_dict(record)
        out["stalls"] = [{**as_dict(r), "step": r.step} for r in stalls]
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


def _quiet_records(s: ExplainSettings) -> list[pb.AuditRecord]:
    """The job's audit records from where the verdict came, or none (never an error: the
    verdict is the answer; these add to it)."""
    try:
        if s.history:
            return _from_file(s.history, _audit_records(s.job))
        if s.etcd:
            return _from_etcd(s, _audit_records(s.job))
        security = security_of(s)
        with security.channel(address_of(s)) as channel:
            reply = pb_grpc.StatusServiceStub(channel).ListAudits(
                pb.ListAuditsRequest(job_id=s.job), timeout=10, metadata=security.metadata
            )
            return list(reply.audits)
    except (OSError, ValueError, CoordinatorError, grpc.RpcError):
        return []


def _explain_audits(s: ExplainSettings) -> int:
    """`explain JOB --audits`: from --history, --etcd, or the coordinator (its history),
    falling back to the history files on this machine when none answers."""
    records: list[pb.AuditRecord] | None = None
    where = ""
    try:
        if s.history:
            where, records = s.history, _from_file(s.history, _audit_records(s.job))
        elif s.etcd:
            where = f"etcd {s.etcd}"
            records = _from_etcd(s, _audit_records(s.job))
        else:
            records = _audits_asked(s)
    except (OSError, ValueError, CoordinatorError) as exc:
        print(f"cohortgate: cannot read the audit history in {where}: {exc}", file=sys.stderr)
        return 1
    if records is None:
        return 1
    if s.json_out:
        # steps as numbers (protobuf's JSON writes 64-bit integers as strings)
        rows = [{**as_dict(r), "step": r.step, "stop_step": r.stop_step} for r in records]
        print(json.dumps(rows, indent=1))
        return 0
    if not records:
        print(
            f"job {s.job}: no audit finding: every audited step agreed, or the job never "
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


def _audits_asked(s: ExplainSettings) -> list[pb.AuditRecord] | None:
    """The coordinator's answer to ListAudits; with none answering, this machine's history
    files (the shared one, and the one `cohortgate run` kept for the job)."""
    addr = address_of(s)
    security = security_of(s)
    with security.channel(addr) as channel:
        try:
            reply = pb_grpc.StatusServiceStub(channel).ListAudits(
                pb.ListAuditsRequest(job_id=s.job), timeout=10, metadata=security.metadata
            )
            return list(reply.audits)
        except grpc.RpcError as exc:
            error = exc
    files = _local_histories(s.job)
    if error.code() is not grpc.StatusCode.UNAVAILABLE or not files:
        say_failure(addr, error)
        return None
    found: list[pb.AuditRecord] = []
    for path in files:
        print(f"cohortgate: no coordinator answers at {addr}; reading {path}", file=sys.stderr)
        try:
            found.extend(_from_file(str(path), _audit_records(s.job)))
        except (OSError, CoordinatorError):  # a file that cannot be read: the next one
            continue
    return sorted(found, key=lambda r: r.at_unix)
