"""A verdict written down: the domain verdict as JSON, and back, exactly as every rank
received it, and who received it. What any `VerdictStore` keeps per verdict (SQLite's
`record` and `members` columns today; the etcd backend stores the same text)."""

from __future__ import annotations

import json
from typing import Any

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.diff import ManifestDiff
from cohortgate.coordinator.decision.verdict import (
    AuditFinding,
    Cause,
    Finding,
    Outcome,
    SignatureClass,
    Verdict,
)


def verdict_to_json(v: Verdict) -> str:
    """The domain verdict as JSON; diffs keep LIST_CAP items per list and their counts, so
    the stored verdict renders and encodes exactly as the one the ranks received."""
    return json.dumps(
        {
            "outcome": v.outcome.value,
            "job_id": v.job_id,
            "round": v.round,
            "cohort_id": v.cohort_id,
            "world_size": v.world_size,
            "reason": v.reason,
            "decided_at": v.decided_at,
            "init_method": v.init_method,
            "cause": v.cause.value if v.cause else None,
            "classes": [
                {
                    "signature": c.signature.hex(),
                    "ranks": ranges.compress(c.ranks),
                    "hosts": list(c.hosts),
                    "manifest_entries": c.manifest_entries,
                    "reference": c.reference,
                    "group": c.group,
                }
                for c in v.classes
            ],
            "diffs": [
                [group, sig.hex(), None if d is None else d.capped().to_dict()]
                for (group, sig), d in v.diffs.items()
            ],
            "findings": [
                [f.check, str(f.level), f.text, ranges.compress(f.ranks)] for f in v.findings
            ],
            "missing_ranks": ranges.compress(v.missing_ranks),
            "present_ranks": ranges.compress(v.present_ranks),
            "report": v.report,
            "headline": v.headline,
        }
    )


def verdict_from_json(text: str) -> Verdict:
    d: dict[str, Any] = json.loads(text)
    return Verdict(
        outcome=Outcome(d["outcome"]),
        job_id=d["job_id"],
        round=d["round"],
        cohort_id=d["cohort_id"],
        world_size=d["world_size"],
        reason=d["reason"],
        decided_at=d["decided_at"],
        init_method=d["init_method"],
        cause=None if d["cause"] is None else Cause(d["cause"]),
        classes=tuple(
            SignatureClass(
                bytes.fromhex(c["signature"]),
                tuple(ranges.expand(c["ranks"])),
                tuple(c["hosts"]),
                c["manifest_entries"],
                c["reference"],
                c["group"],
            )
            for c in d["classes"]
        ),
        diffs={
            (group, bytes.fromhex(sig)): None if diff is None else ManifestDiff.from_dict(diff)
            for group, sig, diff in d["diffs"]
        },
        findings=tuple(
            Finding(check, level, text, tuple(ranges.expand(rs)))
            for check, level, text, rs in d["findings"]
        ),
        missing_ranks=tuple(ranges.expand(d["missing_ranks"])),
        present_ranks=tuple(ranges.expand(d["present_ranks"])),
        report=d["report"],
        headline=d["headline"],
    )


# The members who received a verdict, for replay: the ranks (compressed runs) on the first
# line, then one incarnation per line in rank order. A 16,384-rank cohort encodes in about
# 1 ms (its JSON object took 14 ms, on the writer thread but holding the GIL), and replay
# looks an incarnation up without decoding it.
def members_to_text(members: dict[int, str]) -> str:
    ranks = sorted(members)
    return "\n".join([ranges.compress(ranks), *(members[r] for r in ranks)])


def members_from_text(text: str) -> dict[int, str]:
    if text.startswith("{"):  # written before 0.3: a JSON object {rank: incarnation}
        return {int(k): str(v) for k, v in json.loads(text).items()}
    head, *incarnations = text.split("\n")
    return dict(zip(ranges.expand(head), incarnations, strict=True))


def received(members_text: str, incarnation: str) -> bool:
    """Did `incarnation` take part? (without decoding the members)"""
    if members_text.startswith("{"):
        return incarnation in json.loads(members_text).values()
    return "\n" not in incarnation and f"\n{incarnation}\n" in f"{members_text}\n"


def with_queued(
    stored: list[AuditFinding], queued: list[AuditFinding], limit: int
) -> list[AuditFinding]:
    """A job's findings as stored, then those still queued for the writer (read before the
    store, so that one filed in between is in one or the other, and once), the newest
    `limit`: a finding the ranks were just told is listed at once (explain, ListAudits)."""

    def key(f: AuditFinding) -> tuple[str, int, str, float]:
        return (f.cohort_id, f.step, f.kind, f.at)

    seen = {key(f) for f in stored}
    return (stored + [f for f in queued if key(f) not in seen])[-limit:]
