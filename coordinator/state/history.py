"""Verdict history in SQLite (WAL): every verdict and its full report, kept across restarts.

A verdict is written twice. First its gate: its row in `gates`, a table of a few rows, with
the verdict as every rank received it and who received it (records.members_to_text), all
that replay and listings read; delivery waits for this write only. Then, after delivery, the
row moves to `verdicts`, where 30 days of them and their indexes live, inside SQLite (nothing
encoded again). A coordinator killed between the two leaves a gate, which replays and lists
as it is and is filed by the next coordinator that opens the file."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

import structlog

from cohortgate.coordinator.contract.errors import Unavailable
from cohortgate.coordinator.decision.verdict import AuditFinding, Verdict
from cohortgate.coordinator.state.base import ErrorListener, VerdictRow, VerdictStore
from cohortgate.coordinator.state.history_writes import (
    AUDIT_COLUMNS,
    COLUMNS,
    ROW,
    SCHEMA,
    Writer,
    file_gates,
    migrate,
)
from cohortgate.coordinator.state.records import (
    members_from_text,
    received,
    verdict_from_json,
    with_queued,
)

log = structlog.get_logger("cohortgate")
_T = TypeVar("_T")


class HistoryError(OSError):
    """The history file cannot be used at start; str() is the one line to print."""


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
        self._writer: Writer | None = None
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
        self._writer = Writer(writer_db, self._open_writer, self._failed)
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
        return f"(SELECT {ROW} FROM verdicts UNION ALL SELECT {ROW} FROM gates)"

    def _connect(self, busy_s: float) -> sqlite3.Connection:
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(
            self.path, timeout=busy_s, check_same_thread=False, isolation_level=None
        )
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        migrate(db)
        return db

    def _open_writer(self) -> sqlite3.Connection:
        """The writer's connection (at start, and again after a failed write), which also
        files gates left behind and drops what is past the retention."""
        db = self._connect(WRITE_BUSY_S)
        try:  # what a coordinator killed between its two writes left
            file_gates(db)
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
                f"SELECT {AUDIT_COLUMNS} FROM audits WHERE job_id = ? ORDER BY at DESC LIMIT ?",
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
                f"SELECT {COLUMNS}, members FROM {self._stored()} WHERE job_id = ? "
                "AND round = ? ORDER BY decided_at DESC LIMIT 1",
                (job_id, round_),
            )
        else:
            cur = self.db.execute(
                f"SELECT {COLUMNS}, members FROM {self._stored()} WHERE job_id = ? "
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
                f"SELECT {COLUMNS} FROM {self._stored()} WHERE job_id = ? "
                "ORDER BY decided_at DESC LIMIT ?",
                (job_id, limit),
            )
        else:
            cur = self.db.execute(
                f"SELECT {COLUMNS} FROM {self._stored()} ORDER BY decided_at DESC LIMIT ?",
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
