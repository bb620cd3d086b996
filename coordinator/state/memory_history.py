"""The verdict history in memory: what `serve --history off` keeps while the process lives.

The service always has a `VerdictStore`; without a file (or etcd) it is this one, so every
part of the service reads and records verdicts one way (no "no history" branch anywhere):
a rank that re-joins after its job left the live store still gets its verdict, `GetVerdict`
and the status page list recent verdicts, and a job's rounds keep counting. Nothing
survives a restart. Bounded: the newest verdicts up to `MAX_VERDICTS` and `MAX_MEMBER_CHARS`
of members (one line per rank, as in SQLite), and `MAX_FINDINGS` audit findings per job.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from cohortgate.coordinator.decision.verdict import AuditFinding, Verdict
from cohortgate.coordinator.state.base import ErrorListener, VerdictRow, VerdictStore
from cohortgate.coordinator.state.records import members_from_text, members_to_text, received

MAX_VERDICTS = 10_000
MAX_MEMBER_CHARS = 32 * 1024 * 1024  # about 1M ranks' incarnations
MAX_FINDINGS = 1_000  # per job
MAX_AUDITED_JOBS = 10_000


@dataclasses.dataclass
class Kept:
    """What outlives a handle (as a file outlives a History): tests reopen over it."""

    # (job, round) -> (the row without members or verdict, members as text, the verdict)
    rows: OrderedDict[tuple[str, int], tuple[VerdictRow, str, Verdict | None]] = dataclasses.field(
        default_factory=OrderedDict
    )
    rounds: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # sorted, per job
    member_chars: int = 0
    findings: OrderedDict[str, deque[AuditFinding]] = dataclasses.field(default_factory=OrderedDict)


class MemoryHistory(VerdictStore):
    """Verdicts and audit findings in this process's memory: stored at once, never degraded."""

    def __init__(
        self,
        retention_days: float = 30.0,
        *,
        kept: Kept | None = None,
        clock: Callable[[], float] = time.time,
        max_verdicts: int = MAX_VERDICTS,
        max_member_chars: int = MAX_MEMBER_CHARS,
    ) -> None:
        self.listeners: list[ErrorListener] = []
        self.max_verdicts, self.max_member_chars = max_verdicts, max_member_chars
        self.kept = kept if kept is not None else Kept()
        self.retention_s = retention_days * 86400.0
        self.clock = clock
        self._prune(self.clock() - self.retention_s)

    @property
    def problem(self) -> str:
        return ""

    @property
    def spooled(self) -> int:
        return 0

    def record(self, row: VerdictRow, written: Callable[[], None] | None = None) -> None:
        kept = self.kept
        key = (row.job_id, row.round)
        old = kept.rows.pop(key, None)
        if old is not None:
            kept.member_chars -= len(old[1])
        else:
            rounds = kept.rounds.setdefault(row.job_id, [])
            rounds.append(row.round)
            rounds.sort()
        text = members_to_text(row.members)
        bare = dataclasses.replace(row, members={}, verdict=None)
        kept.rows[key] = (bare, text, row.verdict)
        kept.member_chars += len(text)
        while len(kept.rows) > self.max_verdicts or kept.member_chars > self.max_member_chars:
            self._drop(next(iter(kept.rows)))
        if written is not None:
            written()

    def _drop(self, key: tuple[str, int]) -> None:
        kept = self.kept
        _, text, _ = kept.rows.pop(key)
        kept.member_chars -= len(text)
        rounds = kept.rounds[key[0]]
        rounds.remove(key[1])
        if not rounds:
            del kept.rounds[key[0]]

    def _prune(self, before: float) -> None:
        """Verdicts and findings older than the retention go (as a writing store's do when
        it opens)."""
        for key in [k for k, (row, _, _) in self.kept.rows.items() if row.decided_at < before]:
            self._drop(key)
        for job_id, found in list(self.kept.findings.items()):
            fresh = deque((f for f in found if f.at >= before), maxlen=MAX_FINDINGS)
            if fresh:
                self.kept.findings[job_id] = fresh
            else:
                del self.kept.findings[job_id]

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def get(self, job_id: str, round_: int = 0) -> VerdictRow | None:
        rounds = self.kept.rounds.get(job_id)
        if not rounds:
            return None
        found = self.kept.rows.get((job_id, round_ or rounds[-1]))
        if found is None:
            return None
        row, text, _ = found
        return dataclasses.replace(row, members=members_from_text(text))

    def recent(self, limit: int = 20, job_id: str = "") -> list[VerdictRow]:
        if job_id:
            rows = [self.kept.rows[(job_id, r)][0] for r in self.kept.rounds.get(job_id, [])]
        else:
            rows = [row for row, _, _ in self.kept.rows.values()]
        return sorted(rows, key=lambda r: -r.decided_at)[:limit]

    def verdict_of(self, job_id: str, incarnation: str, rounds: int = 4) -> Verdict | None:
        for round_ in reversed(self.kept.rounds.get(job_id, [])[-rounds:]):
            _, text, verdict = self.kept.rows[(job_id, round_)]
            if verdict is not None and received(text, incarnation):
                return verdict
        return None

    def last_round(self, job_id: str) -> int:
        rounds = self.kept.rounds.get(job_id)
        return rounds[-1] if rounds else 0

    def record_audit(self, finding: AuditFinding) -> None:
        findings = self.kept.findings
        job = findings.get(finding.job_id)
        if job is None:
            job = findings[finding.job_id] = deque(maxlen=MAX_FINDINGS)
            while len(findings) > MAX_AUDITED_JOBS:
                findings.popitem(last=False)
        job.append(finding)

    def audits(self, job_id: str, limit: int = 200) -> list[AuditFinding]:
        found = sorted(self.kept.findings.get(job_id, ()), key=lambda f: f.at)
        return found[-limit:] if limit > 0 else []

    def close(self) -> None:
        pass
