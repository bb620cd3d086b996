"""The SQLite history's schema and writes: the verdict's gate, then its row, and audit
findings, written in batches by one thread (`Writer`), spooled and retried while the file
refuses them (locked, full, read only). state/history.py opens the file and reads it."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable

import structlog

from cohortgate.coordinator.decision.verdict import AuditFinding
from cohortgate.coordinator.state.base import ErrorListener, VerdictRow
from cohortgate.coordinator.state.records import members_to_text, verdict_to_json

log = structlog.get_logger("cohortgate")

# Verdicts waiting to be written while the file refuses them (locked, disk full): a
# coordinator keeps deciding through hours of this; past the spool the oldest go (counted).
SPOOL_MAX = 100_000

# A verdict's row, the same in `gates` and in `verdicts` (a gate moves there as it is).
ROW_COLUMNS = """
    cohort_id    TEXT PRIMARY KEY,
    job_id       TEXT NOT NULL,
    round        INTEGER NOT NULL,
    outcome      TEXT NOT NULL,
    cause        TEXT NOT NULL,
    reason       TEXT NOT NULL,
    report       TEXT NOT NULL,
    world_size   INTEGER NOT NULL,
    decided_at   REAL NOT NULL,
    members      TEXT NOT NULL, -- who received it (records.members_to_text; JSON before 0.3)
    -- JSON of the domain verdict every rank received
    record       TEXT"""
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS verdicts ({ROW_COLUMNS},
    verdict      BLOB           -- before 0.2: the wire Verdict (no longer written or read)
);
CREATE INDEX IF NOT EXISTS verdicts_job_round ON verdicts (job_id, round);
CREATE INDEX IF NOT EXISTS verdicts_decided_at ON verdicts (decided_at);
-- verdicts stored, and sent, but not yet filed
CREATE TABLE IF NOT EXISTS gates ({ROW_COLUMNS}
);
-- audit findings during training (decision/audit.py): divergences, ranks that sent none
CREATE TABLE IF NOT EXISTS audits (
    job_id       TEXT NOT NULL,
    cohort_id    TEXT NOT NULL,
    step         INTEGER NOT NULL,
    kind         TEXT NOT NULL,
    level        TEXT NOT NULL,
    headline     TEXT NOT NULL,
    report       TEXT NOT NULL,
    at           REAL NOT NULL,
    stop_step    INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS audits_job ON audits (job_id, at);
"""
AUDIT_COLUMNS = "job_id, cohort_id, step, kind, level, headline, report, at, stop_step"


# What a listing reads: neither the verdict itself nor who received it (read to replay).
COLUMNS = "cohort_id, job_id, round, outcome, cause, reason, report, world_size, decided_at"
# What a gate holds, and moves to `verdicts`.
ROW = COLUMNS + ", members, record"


def migrate(db: sqlite3.Connection) -> None:
    """Bring a file written by an older coordinator up to this schema, in place."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(verdicts)")}
    for column, kind in (("verdict", "BLOB"), ("record", "TEXT")):
        if column not in columns:
            db.execute(f"ALTER TABLE verdicts ADD COLUMN {column} {kind}")


def _transaction(db: sqlite3.Connection, write: Callable[[], object]) -> None:
    db.execute("BEGIN IMMEDIATE")
    try:
        write()
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _gate(db: sqlite3.Connection, rows: list[VerdictRow]) -> None:
    """Write 1, which delivery waits for; one transaction for the batch."""
    _transaction(
        db,
        lambda: db.executemany(
            f"INSERT OR REPLACE INTO gates ({ROW}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
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
                    members_to_text(row.members),
                    None if row.verdict is None else verdict_to_json(row.verdict),
                )
                for row in rows
            ],
        ),
    )


def file_gates(db: sqlite3.Connection, cohort_ids: list[str] | None = None) -> None:
    """Write 2, after delivery: gates move to `verdicts` (None: every gate there is)."""

    def write() -> None:
        if cohort_ids is None:
            db.execute(f"INSERT OR REPLACE INTO verdicts ({ROW}) SELECT {ROW} FROM gates")
            db.execute("DELETE FROM gates")
            return
        keys = [(c,) for c in cohort_ids]
        db.executemany(
            f"INSERT OR REPLACE INTO verdicts ({ROW}) SELECT {ROW} FROM gates WHERE cohort_id = ?",
            keys,
        )
        db.executemany("DELETE FROM gates WHERE cohort_id = ?", keys)

    _transaction(db, write)


def _audits(db: sqlite3.Connection, findings: list[AuditFinding]) -> None:
    rows = [dataclasses.astuple(f) for f in findings]  # the fields in AUDIT_COLUMNS's order
    _transaction(
        db,
        lambda: db.executemany(f"INSERT INTO audits ({AUDIT_COLUMNS}) VALUES ({_marks(9)})", rows),
    )


def _marks(n: int) -> str:
    return ", ".join("?" * n)


class Writer(threading.Thread):
    """Writes queued verdicts in batches; while the file refuses them (locked, full, read
    only) it keeps them and retries with backoff (0.5 s doubling to 30 s)."""

    def __init__(
        self,
        db: sqlite3.Connection | None,
        connect: Callable[[], sqlite3.Connection],
        failed: ErrorListener,
    ) -> None:
        super().__init__(name="cohortgate-history", daemon=True)
        self.db = db  # None until the file can be opened for writing
        self.connect = connect
        self.failed = failed
        self.cond = threading.Condition()
        self.pending: deque[tuple[VerdictRow, Callable[[], None] | None]] = deque()
        self.filing: deque[str] = deque()  # cohort ids gated (and sent), not yet filed
        self.audits: deque[AuditFinding] = deque()
        self.dropped = 0
        self.error = ""
        self.closing = False
        self.busy = False

    def put(self, row: VerdictRow, written: Callable[[], None] | None) -> None:
        with self.cond:
            if len(self.pending) >= SPOOL_MAX:
                self.pending.popleft()
                self.dropped += 1
            self.pending.append((row, written))
            self.cond.notify_all()

    def put_audit(self, finding: AuditFinding) -> None:
        with self.cond:
            if len(self.audits) >= SPOOL_MAX:
                self.audits.popleft()
                self.dropped += 1
            self.audits.append(finding)
            self.cond.notify_all()

    def pending_count(self) -> int:
        with self.cond:
            return len(self.pending)

    def run(self) -> None:
        backoff = 0.0
        while True:
            with self.cond:
                while not self.pending and not self.filing and not self.audits:
                    if self.closing:
                        return
                    self.cond.wait()
                gates, filing, audits = list(self.pending), list(self.filing), list(self.audits)
                self.busy = True
            try:
                self._write(gates, filing, audits)
            except sqlite3.Error as exc:
                self.error = str(exc)
                self.failed("write", exc)
                backoff = min(max(backoff * 2, 0.5), 30.0)
                with self.cond:
                    self.busy = False
                    self.cond.notify_all()
                    if self.closing:
                        return  # close() reports what is left
                    self.cond.wait(timeout=backoff)
                continue
            backoff = 0.0
            self.error = ""
            with self.cond:
                self.busy = False
                self.cond.notify_all()

    def _write(
        self,
        gates: list[tuple[VerdictRow, Callable[[], None] | None]],
        filing: list[str],
        audits: list[AuditFinding],
    ) -> None:
        if self.db is None:
            self.db = self.connect()
        if gates:
            _gate(self.db, [row for row, _ in gates])
            self._gated(gates)
        if filing:  # gated by an earlier turn of this loop: their ranks have them
            file_gates(self.db, filing)
            with self.cond:
                for _ in filing:
                    self.filing.popleft()
        if audits:
            _audits(self.db, audits)
            with self.cond:
                for _ in audits:
                    self.audits.popleft()

    def _gated(self, batch: list[tuple[VerdictRow, Callable[[], None] | None]]) -> None:
        """The batch's gates are stored: their verdicts may go out; their rows are next."""
        with self.cond:
            for row, _ in batch:
                self.pending.popleft()
                if len(self.filing) >= SPOOL_MAX:  # its gate stays: the next open files it
                    self.filing.popleft()
                self.filing.append(row.cohort_id)
        for _, written in batch:
            if written is not None:
                written()

    def queued_audits(self, job_id: str) -> list[AuditFinding]:
        with self.cond:
            return [f for f in self.audits if f.job_id == job_id]

    def flush(self, timeout: float) -> bool:
        give_up = time.monotonic() + timeout
        with self.cond:
            while self.pending or self.filing or self.audits or self.busy:
                left = give_up - time.monotonic()
                if left <= 0 or (self.error and not self.busy):
                    return False
                self.cond.wait(timeout=min(left, 0.1))
        return True

    def close(self) -> None:
        self.flush(timeout=5.0)
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.join(timeout=5.0)
        if self.filing:
            log.warning(
                "verdict rows not filed; their gates replay them and the next start files them",
                count=len(self.filing),
                error=self.error,
            )
        if self.pending:
            log.error(
                "verdicts not written to the history",
                count=len(self.pending),
                error=self.error,
                advice="every rank received them; only the record is missing",
            )
