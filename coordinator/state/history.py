"""Verdict history in SQLite (WAL): every verdict and its full report, kept across restarts.

A verdict is written twice. First its gate: its row in `gates`, a table of a few rows, with
the verdict as every rank received it and who received it (records.members_to_text), all
that replay and listings read; delivery waits for this write only. Then, after delivery, the
row moves to `verdicts`, where 30 days of them and their indexes live, inside SQLite (nothing
encoded again). A coordinator killed between the two leaves a gate, which replays and lists
as it is and is filed by the next coordinator that opens the file."""

from __future__ import annotations

import dataclasses
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import structlog

from cohortgate.coordinator.contract.errors import Unavailable
from cohortgate.coordinator.decision.audit import AuditFinding
from cohortgate.coordinator.decision.verdict import Verdict
from cohortgate.coordinator.state.base import ErrorListener, VerdictRow, VerdictStore
from cohortgate.coordinator.state.records import (
    members_from_text,
    members_to_text,
    received,
    verdict_from_json,
    verdict_to_json,
    with_queued,
)

log = structlog.get_logger("cohortgate")
_T = TypeVar("_T")

# A verdict's row, the same in `gates` and in `verdicts` (a gate moves there as it is).
_ROW_COLUMNS = """
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
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS verdicts ({_ROW_COLUMNS},
    verdict      BLOB           -- before 0.2: the wire Verdict (no longer written or read)
);
CREATE INDEX IF NOT EXISTS verdicts_job_round ON verdicts (job_id, round);
CREATE INDEX IF NOT EXISTS verdicts_decided_at ON verdicts (decided_at);
-- verdicts stored, and sent, but not yet filed
CREATE TABLE IF NOT EXISTS gates ({_ROW_COLUMNS}
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
_AUDIT = "job_id, cohort_id, step, kind, level, headline, report, at, stop_step"


# What a listing reads: neither the verdict itself nor who received it (read to replay).
_COLUMNS = "cohort_id, job_id, round, outcome, cause, reason, report, world_size, decided_at"
# What a gate holds, and moves to `verdicts`.
_ROW = _COLUMNS + ", members, record"


def _migrate(db: sqlite3.Connection) -> None:
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
            f"INSERT OR REPLACE INTO gates ({_ROW}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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


def _file(db: sqlite3.Connection, cohort_ids: list[str] | None = None) -> None:
    """Write 2, after delivery: gates move to `verdicts` (None: every gate there is)."""

    def write() -> None:
        if cohort_ids is None:
            db.execute(f"INSERT OR REPLACE INTO verdicts ({_ROW}) SELECT {_ROW} FROM gates")
            db.execute("DELETE FROM gates")
            return
        keys = [(c,) for c in cohort_ids]
        db.executemany(
            f"INSERT OR REPLACE INTO verdicts ({_ROW}) SELECT {_ROW} FROM gates "
            "WHERE cohort_id = ?",
            keys,
        )
        db.executemany("DELETE FROM gates WHERE cohort_id = ?", keys)

    _transaction(db, write)


def _audits(db: sqlite3.Connection, findings: list[AuditFinding]) -> None:
    rows = [dataclasses.astuple(f) for f in findings]  # the fields in _AUDIT's order
    _transaction(
        db, lambda: db.executemany(f"INSERT INTO audits ({_AUDIT}) VALUES ({_marks(9)})", rows)
    )


def _marks(n: int) -> str:
    return ", ".join("?" * n)


class _Writer(threading.Thread):
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
            _file(self.db, filing)
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


class HistoryError(OSError):
    """The history file cannot be used at start; str() is the one line to print."""


# Verdicts waiting to be written while the file refuses them (locked, disk full): a
# coordinator keeps deciding through hours of this; past the spool the oldest go (counted).
SPOOL_MAX = 100_000
# A read on the event loop waits at most this long for a lock another process holds.
READ_BUSY_S = 0.1
WRITE_BUSY_S = 2.0


class History(VerdictStore):
    """One SQLite file. History is a record, never a gate: verdicts are written by a writer
    thread (spooled and retried while the file refuses them), reads on the event loop wait
    at most READ_BUSY_S, and every failure is counted, logged and shown in health."""

    def __init__(
        self, path: Path | str, retention_days: float = 30.0, *, readonly: bool = False
    ) -> None:
        self.path = str(path)
        self.retention_s = retention_days * 86400
        self.listeners: list[ErrorListener] = []
        self._writer: _Writer | None = None
        self._has_gates: bool | None = None  # (see _stored)
        try:
            if readonly:  # `cohortgate explain --history`: read a file, change nothing
                self.db = self._open_readonly()
                return
            first_error: sqlite3.OperationalError | None = None
            try:
                writer_db: sqlite3.Connection | None = self._open_writer()
            except sqlite3.OperationalError as exc:
                if self.path == ":memory:" or not Path(self.path).is_file():
                    raise
                # A file we can read but not write (read-only filesystem, permissions):
                # serve, replay and explain from it; new verdicts wait in the spool.
                writer_db, first_error = None, exc
            # ":memory:" is one database per connection: reader and writer share it there.
            if writer_db is not None and self.path == ":memory:":
                self.db = writer_db
            elif writer_db is not None:
                self.db = self._connect(READ_BUSY_S)
            else:
                self.db = self._open_readonly()
        except sqlite3.Error as exc:
            raise HistoryError(
                f"--history {self.path}: cannot use the verdict history ({exc}); move the "
                "file aside (a new one is created) or pass --history off"
            ) from None
        self._writer = _Writer(writer_db, self._open_writer, self._failed)
        if first_error is not None:
            self._writer.error = str(first_error)
            self._failed("open", first_error)
        self._writer.start()

    def _open_readonly(self) -> sqlite3.Connection:
        uri = Path(self.path).resolve().as_uri()
        if not any(Path(f"{self.path}-{part}").exists() for part in ("wal", "shm")):
            # No -wal or -shm: no coordinator has the file open (a writer keeps both while
            # it does). Read it as it is, leaving no -wal/-shm of our own beside it.
            return self._reader(uri + "?mode=ro&immutable=1")
        try:
            return self._reader(uri + "?mode=ro")
        except sqlite3.OperationalError:
            # A WAL file on a read-only filesystem cannot create its -shm: read it as is.
            return self._reader(uri + "?mode=ro&immutable=1")

    @staticmethod
    def _reader(uri: str) -> sqlite3.Connection:
        db = sqlite3.connect(uri, uri=True, timeout=READ_BUSY_S, check_same_thread=False)
        db.execute("SELECT COUNT(*) FROM verdicts").fetchone()  # not a database: fails here
        return db

    def _stored(self) -> str:
        """What reads read: the filed rows and the gates (a file of a coordinator before 0.3,
        read-only, has no gates)."""
        if self._has_gates is None:
            found = self.db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'gates'"
            ).fetchone()
            self._has_gates = found is not None
        if not self._has_gates:
            return "verdicts"
        return f"(SELECT {_ROW} FROM verdicts UNION ALL SELECT {_ROW} FROM gates)"

    def _connect(self, busy_s: float) -> sqlite3.Connection:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(
            self.path, timeout=busy_s, check_same_thread=False, isolation_level=None
        )
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        _migrate(db)
        return db

    def _open_writer(self) -> sqlite3.Connection:
        """The writer's connection (at start, and again after a failed write), which also
        files gates left behind and drops what is past the retention."""
        db = self._connect(WRITE_BUSY_S)
        try:  # what a coordinator killed between its two writes left
            _file(db)
        except sqlite3.Error as exc:  # they still replay and list from their gates
            log.warning(
                "gated verdicts could not be filed; retried at the next start", error=str(exc)
            )
        cutoff = time.time() - self.retention_s
        db.execute("DELETE FROM verdicts WHERE decided_at < ?", (cutoff,))
        db.execute("DELETE FROM gates WHERE decided_at < ?", (cutoff,))
        db.execute("DELETE FROM audits WHERE at < ?", (cutoff,))
        return db

    def _failed(self, op: str, exc: Exception) -> None:
        log.warning(
            "history " + op + " failed",
            error=str(exc),
            file=self.path,
            advice="verdicts are still sent to every rank; the record is retried",
        )
        for listener in self.listeners:
            listener(op, exc)

    @property
    def spooled(self) -> int:
        """Verdicts not yet written (the file refuses them, or the writer is behind)."""
        return self._writer.pending_count() if self._writer is not None else 0

    @property
    def problem(self) -> str:
        """Why history is degraded ("" when it is not): the coordinator keeps serving."""
        writer = self._writer
        if writer is not None and writer.error:
            lost = f", {writer.dropped} dropped past the spool" if writer.dropped else ""
            return f"{writer.error} ({self.spooled} verdicts waiting to be written{lost})"
        return ""

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            if self._writer.db is not None and self._writer.db is not self.db:
                self._writer.db.close()
        self.db.close()

    def record(self, row: VerdictRow, written: Callable[[], None] | None = None) -> None:
        """Queue the verdict for the writer thread; never blocks, never raises. `written` is
        called from the writer thread once the row is committed."""
        if self._writer is None:
            raise HistoryError(f"--history {self.path} is open read-only")
        self._writer.put(row, written)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued verdict is written; False if it could not be in time."""
        return self._writer is None or self._writer.flush(timeout)

    def record_audit(self, finding: AuditFinding) -> None:
        if self._writer is None:
            raise HistoryError(f"--history {self.path} is open read-only")
        self._writer.put_audit(finding)

    def audits(self, job_id: str, limit: int = 200) -> list[AuditFinding]:
        """The job's findings, oldest first, those still queued for the writer included: a
        finding is answered to the ranks before the writer thread files it, and whoever reads
        right after (`explain`, ListAudits) must see it. The queue is read before the file,
        so a finding filed in between is found in one or the other."""
        queued = self._writer.queued_audits(job_id) if self._writer is not None else []

        def read() -> list[AuditFinding]:
            return with_queued(stored_audits(), queued, limit)

        def stored_audits() -> list[AuditFinding]:
            found = self.db.execute(
                "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'audits'"
            ).fetchone()
            if found is None:  # a file of a coordinator before audits
                return []
            cur = self.db.execute(
                f"SELECT {_AUDIT} FROM audits WHERE job_id = ? ORDER BY at DESC LIMIT ?",
                (job_id, limit),
            )
            return [_finding(r) for r in reversed(cur.fetchall())]

        return self._listing(read)

    def _read(self, op: str, read: Callable[[], _T], default: _T) -> _T:
        """A read on the event loop: a failure (locked past READ_BUSY_S, unreadable file)
        is counted and logged, and the caller gets `default`, as if nothing were stored."""
        try:
            return read()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            return default

    def get(self, job_id: str, round_: int = 0) -> VerdictRow | None:
        """The verdict of (job, round); round 0 means the job's latest."""
        return self._listing(lambda: self._get(job_id, round_))

    def _listing(self, read: Callable[[], _T]) -> _T:
        """A read someone asked for (status, explain): a failure says so (UNAVAILABLE)."""
        try:
            return read()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            raise Unavailable(
                f"the verdict history {self.path} cannot be read now ({exc}); retry, or read "
                "the coordinator's log"
            ) from None

    def _get(self, job_id: str, round_: int) -> VerdictRow | None:
        if round_:
            cur = self.db.execute(
                f"SELECT {_COLUMNS}, members FROM {self._stored()} WHERE job_id = ? "
                "AND round = ? ORDER BY decided_at DESC LIMIT 1",
                (job_id, round_),
            )
        else:
            cur = self.db.execute(
                f"SELECT {_COLUMNS}, members FROM {self._stored()} WHERE job_id = ? "
                "ORDER BY round DESC, decided_at DESC LIMIT 1",
                (job_id,),
            )
        found = cur.fetchone()
        if found is None:
            return None
        return replace(_row(found), members=members_from_text(str(found[9])))

    def recent(self, limit: int = 20, job_id: str = "") -> list[VerdictRow]:
        return self._listing(lambda: self._recent(limit, job_id))

    def _recent(self, limit: int, job_id: str) -> list[VerdictRow]:
        if job_id:
            cur = self.db.execute(
                f"SELECT {_COLUMNS} FROM {self._stored()} WHERE job_id = ? "
                "ORDER BY decided_at DESC LIMIT ?",
                (job_id, limit),
            )
        else:
            cur = self.db.execute(
                f"SELECT {_COLUMNS} FROM {self._stored()} ORDER BY decided_at DESC LIMIT ?",
                (limit,),
            )
        return [_row(r) for r in cur.fetchall()]

    def verdict_of(self, job_id: str, incarnation: str, rounds: int = 4) -> Verdict | None:
        """The stored verdict of a recent round of `job_id` that `incarnation` took part in:
        a rank re-joining after a coordinator restart gets the verdict it would have had.
        Asked on every new job's first join: an unreadable file answers None."""
        return self._read("read", lambda: self._verdict_of(job_id, incarnation, rounds), None)

    def _verdict_of(self, job_id: str, incarnation: str, rounds: int) -> Verdict | None:
        cur = self.db.execute(
            f"SELECT members, record FROM {self._stored()} WHERE job_id = ? "
            "ORDER BY round DESC LIMIT ?",
            (job_id, rounds),
        )
        for members, record in cur.fetchall():
            if record and received(members, incarnation):
                return verdict_from_json(record)
        return None

    def last_round(self, job_id: str) -> int:
        """The job's last recorded round (0: none, or the file is unreadable now)."""

        def read() -> int:
            query = f"SELECT MAX(round) FROM {self._stored()} WHERE job_id = ?"
            return int(self.db.execute(query, (job_id,)).fetchone()[0] or 0)

        return self._read("read", read, 0)


def _finding(r: tuple[object, ...]) -> AuditFinding:
    return AuditFinding(
        job_id=str(r[0]),
        cohort_id=str(r[1]),
        step=int(str(r[2])),
        kind=str(r[3]),
        level=str(r[4]),
        headline=str(r[5]),
        report=str(r[6]),
        at=float(str(r[7])),
        stop_step=int(str(r[8])),
    )


def _row(r: tuple[object, ...]) -> VerdictRow:
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
    )
