"""Verdict history in SQLite (WAL): every verdict and its full report, kept across restarts."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import structlog

from coordinator.contract.errors import Unavailable
from coordinator.decision.verdict import Verdict
from coordinator.state.base import ErrorListener, VerdictRow, VerdictStore
from coordinator.state.records import verdict_from_json, verdict_to_json

log = structlog.get_logger("cohortgate")
_T = TypeVar("_T")

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


def _migrate(db: sqlite3.Connection) -> None:
    """Bring a file written by an older coordinator up to this schema, in place."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(verdicts)")}
    for column, kind in (("verdict", "BLOB"), ("record", "TEXT")):
        if column not in columns:
            db.execute(f"ALTER TABLE verdicts ADD COLUMN {column} {kind}")


def _insert(db: sqlite3.Connection, rows: list[VerdictRow]) -> None:
    """One transaction for the batch."""
    db.execute("BEGIN IMMEDIATE")
    try:
        db.executemany(
            "INSERT OR REPLACE INTO verdicts (cohort_id, job_id, round, outcome, cause, reason, "
            "report, world_size, decided_at, members, record) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                    json.dumps({str(k): v for k, v in row.members.items()}),
                    None if row.verdict is None else verdict_to_json(row.verdict),
                )
                for row in rows
            ],
        )
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


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

    def pending_count(self) -> int:
        with self.cond:
            return len(self.pending)

    def run(self) -> None:
        backoff = 0.0
        while True:
            with self.cond:
                while not self.pending and not self.closing:
                    self.cond.wait()
                if not self.pending:
                    return
                batch = list(self.pending)
                self.busy = True
            try:
                if self.db is None:
                    self.db = self.connect()
                _insert(self.db, [row for row, _ in batch])
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
                for _ in batch:
                    self.pending.popleft()
                self.busy = False
                self.cond.notify_all()
            for _, written in batch:
                if written is not None:
                    written()

    def flush(self, timeout: float) -> bool:
        give_up = time.monotonic() + timeout
        with self.cond:
            while self.pending or self.busy:
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
        try:
            if readonly:  # `cohortgate explain --history`: read a file, change nothing
                self.db = self._open_readonly()
                return
            first_error: sqlite3.OperationalError | None = None
            try:
                writer_db: sqlite3.Connection | None = self._open(WRITE_BUSY_S)
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
                self.db = self._open(READ_BUSY_S)
            else:
                self.db = self._open_readonly()
        except sqlite3.Error as exc:
            raise HistoryError(
                f"--history {self.path}: cannot use the verdict history ({exc}); move the "
                "file aside (a new one is created) or pass --history off"
            ) from None
        self._writer = _Writer(writer_db, lambda: self._open(WRITE_BUSY_S), self._failed)
        if first_error is not None:
            self._writer.error = str(first_error)
            self._failed("open", first_error)
        self._writer.start()

    def _open_readonly(self) -> sqlite3.Connection:
        uri = Path(self.path).resolve().as_uri()
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

    def _open(self, busy_s: float) -> sqlite3.Connection:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(
            self.path, timeout=busy_s, check_same_thread=False, isolation_level=None
        )
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        _migrate(db)
        db.execute("DELETE FROM verdicts WHERE decided_at < ?", (time.time() - self.retention_s,))
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
        return self._listing(lambda: self._recent(limit, job_id))

    def _recent(self, limit: int, job_id: str) -> list[VerdictRow]:
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
        a rank re-joining after a coordinator restart gets the verdict it would have had.
        Asked on every new job's first join: an unreadable file answers None."""
        return self._read("read", lambda: self._verdict_of(job_id, incarnation, rounds), None)

    def _verdict_of(self, job_id: str, incarnation: str, rounds: int) -> Verdict | None:
        cur = self.db.execute(
            "SELECT members, record FROM verdicts WHERE job_id = ? ORDER BY round DESC LIMIT ?",
            (job_id, rounds),
        )
        for members, record in cur.fetchall():
            if record and incarnation in json.loads(members).values():
                return verdict_from_json(record)
        return None

    def last_round(self, job_id: str) -> int:
        """The job's last recorded round (0: none, or the file is unreadable now)."""

        def read() -> int:
            query = "SELECT MAX(round) FROM verdicts WHERE job_id = ?"
            return int(self.db.execute(query, (job_id,)).fetchone()[0] or 0)

        return self._read("read", read, 0)


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
