"""Servicer-side domain -> proto: verdicts, join events, status and history records out.
(Requests in are `rpc`; the agent-safe part is `codec.wire`.)"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec.wire import (
    STATE_TO_PB,
    entry_to_pb,
)
from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.diff import (
    CATEGORIES,
    CHANGE_FIELDS,
    LIST_CAP,
    Change,
    ManifestDiff,
    OrderChange,
)
from cohortgate.coordinator.contract.diff import FirstDifference as DomainFirstDifference
from cohortgate.coordinator.decision.audit import Answer
from cohortgate.coordinator.decision.cohort import UploadKind
from cohortgate.coordinator.decision.verdict import AuditFinding, Cause, Outcome, Verdict
from cohortgate.coordinator.service.events import JoinEvent, UploadAsk
from cohortgate.coordinator.service.status import CohortSummary
from cohortgate.coordinator.state.base import LiveCohort, VerdictRow


def _causes() -> dict[Cause, pb.Refusal.Cause.ValueType]:
    """Each domain cause as the wire's Refusal.Cause of the same name: a cause added
    without its proto value stops the coordinator at import, not at its first refusal."""
    named = set(pb.Refusal.Cause.keys())
    missing = [c.name for c in Cause if "CAUSE_" + c.name not in named]
    if missing:
        raise ImportError(
            f"Cause {', '.join(missing)} has no CAUSE_<NAME> value in Refusal.Cause "
            "(proto/cohortgate/coordinator/api/v1/cohort.proto): add it there and run `make proto`"
        )
    return {c: pb.Refusal.Cause.Value("CAUSE_" + c.name) for c in Cause}


_CAUSE_TO_PB = _causes()


def summary_to_pb(s: CohortSummary) -> pb.CohortSummary:
    return pb.CohortSummary(
        job_id=s.job_id,
        round=s.round,
        state=STATE_TO_PB[s.state],
        joined=s.joined,
        expected=s.expected,
        age_seconds=s.age_s,
        deadline_in_seconds=s.deadline_in_s,
        missing_ranks=s.missing_ranks,
        reason=s.reason,
        first_join_unix=s.first_join_at,
        decided_at_unix=s.decided_at,
        cohort_id=s.cohort_id,
        signatures=s.signatures,
    )


def detail_to_pb(summary: CohortSummary, cohort: LiveCohort) -> pb.CohortDetail:
    msg = pb.CohortDetail(summary=summary_to_pb(summary))
    for rank in sorted(cohort.state.members):
        m = cohort.state.members[rank]
        msg.ranks.add(
            rank=m.rank,
            host=m.host,
            pid=m.pid,
            incarnation=m.incarnation,
            joined_unix=m.joined_at,
            last_seen_unix=m.last_seen,
            signature=m.signature.hex()[:12],
            local_rank=m.local_rank,
        )
    for d in cohort.state.departures[-100:]:
        msg.departures.add(rank=d.rank, host=d.host, incarnation=d.incarnation, at_unix=d.at)
    if cohort.verdict is not None:
        msg.verdict.CopyFrom(verdict_to_pb(cohort.verdict))
    return msg


def record_to_pb(row: VerdictRow) -> pb.VerdictRecord:
    return pb.VerdictRecord(
        job_id=row.job_id,
        round=row.round,
        cohort_id=row.cohort_id,
        outcome=row.outcome,
        cause=row.cause,
        reason=row.reason,
        report=row.report,
        decided_at_unix=row.decided_at,
        world_size=row.world_size,
    )


def answer_to_pb(a: Answer) -> pb.AuditAnswer:
    return pb.AuditAnswer(
        cohort_id=a.cohort_id,
        tensors_rank=[r for r, _ in a.tensors_for],
        tensors_step=[s for _, s in a.tensors_for],
        stop_step=a.stop_step,
        headline=a.headline,
        report=a.report,
        diverged_step=a.diverged_step,
        level=a.level,
        compared_until=a.compared_until,
        snapshot_wanted=a.stall.snapshot_wanted,
        stall_id=a.stall.stall_id,
        stall_headline=a.stall.headline,
        stall_report=a.stall.report,
        stall_stop=a.stall.stop,
    )


def finding_to_pb(f: AuditFinding) -> pb.AuditRecord:
    return pb.AuditRecord(
        job_id=f.job_id,
        cohort_id=f.cohort_id,
        step=f.step,
        kind=f.kind,
        level=f.level,
        headline=f.headline,
        report=f.report,
        at_unix=f.at,
        stop_step=f.stop_step,
    )


# -- verdicts -------------------------------------------------------------------------
def _changes(items: tuple[Change, ...]) -> list[pb.EntryChange]:
    return [
        pb.EntryChange(name=c.name, reference=entry_to_pb(c.reference), other=entry_to_pb(c.other))
        for c in items[:LIST_CAP]
    ]


def _orders(items: tuple[OrderChange, ...]) -> list[pb.OrderChange]:
    return [
        pb.OrderChange(
            kind=o.kind,
            position=o.position,
            reference_name=o.reference_name,
            other_name=o.other_name,
        )
        for o in items
    ]


def _first(first: DomainFirstDifference | None) -> pb.FirstDifference | None:
    if first is None:
        return None
    msg = pb.FirstDifference(position=first.position)
    if first.reference is not None:
        msg.reference.CopyFrom(entry_to_pb(first.reference))
    if first.other is not None:
        msg.other.CopyFrom(entry_to_pb(first.other))
    return msg


def diff_to_pb(d: ManifestDiff | None) -> pb.ManifestDiff:
    if d is None:
        return pb.ManifestDiff(available=False)
    msg = pb.ManifestDiff(
        available=True,
        rendered=d.render(),
        reference_size=d.reference_size,
        other_size=d.other_size,
        missing=[entry_to_pb(e) for e in d.missing[:LIST_CAP]],
        extra=[entry_to_pb(e) for e in d.extra[:LIST_CAP]],
        order_changed=_orders(d.order_changed),
    )
    first = _first(d.first_difference)
    if first is not None:
        msg.first_difference.CopyFrom(first)
    for attr in CHANGE_FIELDS:
        getattr(msg, attr).extend(_changes(getattr(d, attr)))
    for key in CATEGORIES:
        msg.counts[key] = d.count(key)
    return msg


def verdict_to_pb(v: Verdict) -> pb.Verdict:
    msg = pb.Verdict(
        outcome=pb.Verdict.OUTCOME_FORMED
        if v.outcome is Outcome.FORMED
        else pb.Verdict.OUTCOME_REFUSED,
        job_id=v.job_id,
        round=v.round,
        cohort_id=v.cohort_id,
        world_size=v.world_size,
        init_method=v.init_method,
        reason=v.reason,
        decided_at_unix=v.decided_at,
        warnings=v.warnings,
    )
    if v.outcome is Outcome.REFUSED and v.cause is not None:
        msg.refusal.cause = _CAUSE_TO_PB[v.cause]
        msg.refusal.report = v.report
        msg.refusal.headline = v.headline
        msg.refusal.missing_ranks = ranges.compress(v.missing_ranks)
        msg.refusal.present_ranks = ranges.compress(v.present_ranks)
        for c in v.classes:
            cls = msg.refusal.classes.add(
                signature=c.signature,
                ranks=c.ranks_text,
                hosts=c.hosts[:WIRE_HOSTS],
                host_count=len(c.hosts),
                reference=c.reference,
                manifest_entries=c.manifest_entries,
            )
            cls.group = c.group
            if not c.reference:
                cls.diff.CopyFrom(diff_to_pb(v.diffs.get((c.group, c.signature))))
        for f in v.findings:
            msg.refusal.findings.add(
                check=f.check, level=f.level, text=f.text, ranks=ranges.compress_capped(f.ranks)
            )
    return msg


# Hosts listed per signature class in a verdict (the count says how many): a refused 16k-rank
# cohort's classes span 2,048 hosts, 22 KB of names in every rank's verdict, 360 MB in all.
WIRE_HOSTS = 64

# Every rank of a cohort receives the same verdict: convert and serialise it once, not once
# per rank (a refused 16k-rank cohort's report and diffs would otherwise be rebuilt and
# re-encoded 16k times). The bytes go out as they are (see _serializer).
_VERDICT_EVENTS: OrderedDict[str, bytes] = OrderedDict()
_VERDICT_EVENTS_KEPT = 256


def _verdict_event(verdict: Verdict) -> bytes:
    cached = _VERDICT_EVENTS.get(verdict.cohort_id)
    if cached is None:
        cached = pb.JoinEvent(verdict=verdict_to_pb(verdict)).SerializeToString()
        _VERDICT_EVENTS[verdict.cohort_id] = cached
        while len(_VERDICT_EVENTS) > _VERDICT_EVENTS_KEPT:
            _VERDICT_EVENTS.popitem(last=False)
    return cached


def event_to_pb(event: JoinEvent) -> pb.JoinEvent | bytes:
    if isinstance(event, Verdict):
        return _verdict_event(event)
    if isinstance(event, UploadAsk):
        ref = event.ref
        if event.kind is not UploadKind.MANIFEST:  # per-tensor digests, or code files
            files = event.kind is UploadKind.FILES
            return pb.JoinEvent(
                digest_request=pb.DigestRequest(
                    job_id=ref.job_id, round=ref.round, rank=ref.rank, files=files
                )
            )
        return pb.JoinEvent(
            manifest_request=pb.ManifestRequest(
                signature=event.key, job_id=ref.job_id, round=ref.round, rank=ref.rank
            )
        )
    said = asdict(event)  # the wire's Progress has the same fields, but one name
    said["deadline_in_seconds"] = said.pop("deadline_in_s")
    return pb.JoinEvent(progress=pb.Progress(**said))
