"""Verdict history in SQLite (WAL): every verdict and its full report, kept across restarts."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from coordinator.contract import ranges
from coordinator.contract.diff import ManifestDiff
from coordinator.decision.checks import Finding
from coordinator.decision.cohort import Cause, Outcome, SignatureClass
from coordinator.decision.report import Verdict
from coordinator.state.base import VerdictRow, VerdictStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS verdicts (
    cohort_id    TEXT PRIMARY KEY,
    job_id       TEXT NOT NULL,
    round        INTEGER NOT NULL,
    outcome      TEXT NOT NULL,
    cause        TEXT NOT NULL,
    reason       TEXT NOT NULL,
    report       TEXT NOT NULL,
    world_size   INTEGER NOT NULL,
    decided_at   REAL NOT NULL,
    members      TEXT NOT NULL, -- JSON {rank: incarnation}, to replay a verdict after restart
    verdict      BLOB,          -- before 0.2: the wire Verdict (no longer written or read)
    record       TEXT           -- JSON of the domain verdict every rank received
);
CREATE INDEX IF NOT EXISTS verdicts_job_round ON verdicts (job_id, round);
CREATE INDEX IF NOT EXISTS verdicts_decided_at ON verdicts (decided_at);
"""


# What a listing reads: everything but the verdict itself (decoded only to replay it).
_COLUMNS = (
    "cohort_id, job_id, round, outcome, cause, reason, report, world_size, decided_at, members"
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


class History(VerdictStore):
    """One SQLite file. Writes are small and rare (one per verdict), so they run inline."""

    def __init__(
        self, path: Path | str, retention_days: float = 30.0, *, readonly: bool = False
    ) -> None:
        self.path = str(path)
        self.retention_s = retention_days * 86400
        if readonly:  # `cohortgate explain --history`: read a file, change nothing
            uri = Path(self.path).resolve().as_uri() + "?mode=ro"
            self.db = sqlite3.connect(uri, uri=True, check_same_thread=False)
            return
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        # check_same_thread=False: the status page reads from its HTTP thread; sqlite3
        # serialises access to one connection itself.
        self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)
        self._migrate()
        self.prune()

    def _migrate(self) -> None:
        """Bring a file written by an older coordinator up to this schema, in place."""
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(verdicts)")}
        for column, kind in (("verdict", "BLOB"), ("record", "TEXT")):
            if column not in columns:
                self.db.execute(f"ALTER TABLE verdicts ADD COLUMN {column} {kind}")

    def close(self) -> None:
        self.db.close()

    def record(self, row: VerdictRow) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO verdicts (cohort_id, job_id, round, outcome, cause, reason, "
            "report, world_size, decided_at, members, record) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                row.cohort_id,
                row.job_id,
                row.round,
                row.outcome,
                row.cause,
                row.reason,
                row.report,
                row.world_size,
                row.decided_at,
                json.dumps({str(k): v for k, v in row.members.items()}),
                None if row.verdict is None else verdict_to_json(row.verdict),
            ),
        )

    def prune(self, now: float | None = None) -> int:
        """Forget verdicts older than the retention; returns how many went."""
        cutoff = (time.time() if now is None else now) - self.retention_s
        return self.db.execute("DELETE FROM verdicts WHERE decided_at < ?", (cutoff,)).rowcount

    def get(self, job_id: str, round_: int = 0) -> VerdictRow | None:
        """The verdict of (job, round); round 0 means the job's latest."""
        if round_:
            cur = self.db.execute(
                f"SELECT {_COLUMNS} FROM verdicts WHERE job_id = ? AND round = ? "
                "ORDER BY decided_at DESC LIMIT 1",
                (job_id, round_),
            )
        else:
            cur = self.db.execute(
                f"SELECT {_COLUMNS} FROM verdicts WHERE job_id = ? "
                "ORDER BY round DESC, decided_at DESC LIMIT 1",
                (job_id,),
            )
        found = cur.fetchone()
        return None if found is None else _row(found)

    def recent(self, limit: int = 20, job_id: str = "") -> list[VerdictRow]:
        if job_id:
            cur = self.db.execute(
                f"SELECT {_COLUMNS} FROM verdicts WHERE job_id = ? "
                "ORDER BY decided_at DESC LIMIT ?",
                (job_id, limit),
            )
        else:
            cur = self.db.execute(
                f"SELECT {_COLUMNS} FROM verdicts ORDER BY decided_at DESC LIMIT ?", (limit,)
            )
        return [_row(r) for r in cur.fetchall()]

    def verdict_of(self, job_id: str, incarnation: str, rounds: int = 4) -> Verdict | None:
        """The stored verdict of a recent round of `job_id` that `incarnation` took part in:
        a rank re-joining after a coordinator restart gets the verdict it would have had."""
        cur = self.db.execute(
            "SELECT members, record FROM verdicts WHERE job_id = ? ORDER BY round DESC LIMIT ?",
            (job_id, rounds),
        )
        for members, record in cur.fetchall():
            if record and incarnation in json.loads(members).values():
                return verdict_from_json(record)
        return None

    def last_round(self, job_id: str) -> int:
        found = self.db.execute(
            "SELECT MAX(round) FROM verdicts WHERE job_id = ?", (job_id,)
        ).fetchone()
        return int(found[0] or 0)


def _row(r: tuple[object, ...]) -> VerdictRow:
    members = json.loads(str(r[9]))
    return VerdictRow(
        cohort_id=str(r[0]),
        job_id=str(r[1]),
        round=int(str(r[2])),
        outcome=str(r[3]),
        cause=str(r[4]),
        reason=str(r[5]),
        report=str(r[6]),
        world_size=int(str(r[7])),
        decided_at=float(str(r[8])),
        members={int(k): str(v) for k, v in members.items()},
    )
