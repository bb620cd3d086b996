"""Verdict history in etcd, shared by the replicas of an active/standby coordinator.

One key per verdict, `<prefix>v/<job>/<round>`, holding the same record as SQLite's gate
(state/records.py: the verdict as the ranks received it, and who received it), zlib-packed.
A record over PART_BYTES (a cohort of ~30,000 ranks or more: one incarnation per line) is
cut into parts under `<prefix>p/<job>/<round>/<i>`, written first; the verdict's own key,
which names its parts, is written last. That last write is fenced: a transaction that holds
only while this replica's leader key is the one it created (etcd/leader.py), so a replica
that no longer leads stores nothing, and delivery (which waits for `written`) sends nothing.

Reads never wait on etcd: every replica keeps the listing of every verdict in memory, and
the records of each job's newest KEEP_RECORDS rounds (replay reads those), catching up from
etcd incrementally (a Range from the last revision seen): a standby every REFRESH_S, a
replica that wins the lead before it admits anything. Verdicts older than the retention
are deleted by the leader (at takeover, then hourly).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, replace
from urllib.parse import quote

import structlog

from cohortgate.coordinator.contract.errors import Unavailable
from cohortgate.coordinator.decision.verdict import AuditFinding, Verdict
from cohortgate.coordinator.etcd.client import EtcdError, EtcdThread, created_at, prefix_end, put_op
from cohortgate.coordinator.state.base import ErrorListener, VerdictRow, VerdictStore
from cohortgate.coordinator.state.etcd_records import Entry, listing, pack, row_of
from cohortgate.coordinator.state.records import (
    members_from_text,
    received,
    verdict_from_json,
    with_queued,
)

log = structlog.get_logger("cohortgate")

# One etcd request carries at most 1.5 MiB (etcd's --max-request-bytes default): a record
# is cut into parts of this size, each its own Put.
PART_BYTES = 1 << 20
MAX_PARTS = 64  # 64 MiB packed: far past any cohort the limits admit
KEEP_RECORDS = 8  # records kept in memory per job (replay reads the newest 4 rounds)
REFRESH_S = 1.0
PRUNE_EVERY_S = 3600.0
PAGE = 256  # keys per Range page when catching up
WRITE_TRIES = 3
READ_WAIT_S = 0.5  # a read of an old record, from the event loop: never longer
UNPACKED = 16  # records kept unpacked (the last read), whatever their size


class EtcdHistory(VerdictStore):
    """The VerdictStore on etcd. `token()` is the leadership's fencing token (0: this
    replica does not lead, and writes nothing); `lost(why)` steps it down when a fenced
    write fails."""

    def __init__(
        self,
        etcd: EtcdThread,
        retention_days: float = 30.0,
        *,
        token: Callable[[], int] = lambda: 0,
        lost: Callable[[str], None] = lambda why: None,
        readonly: bool = False,
        leader_key: bytes | None = None,
    ) -> None:
        self.etcd = etcd
        self.prefix = etcd.settings.key_prefix
        self.leader_key = leader_key or self.prefix + b"leader"
        self.retention_s = retention_days * 86400
        self.token, self._lost = token, lost
        self.readonly = readonly
        self.listeners: list[ErrorListener] = []
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[int, Entry]] = {}
        self._unpacked: OrderedDict[tuple[str, int], tuple[str | None, str]] = OrderedDict()
        self._revision = 0  # etcd revision the cache has caught up to
        self._pending = 0
        self._queued_audits: list[AuditFinding] = []  # submitted, not yet written
        self._error = ""
        self._pruned_at = float("-inf")  # monotonic: never yet
        self._closing = False
        try:
            self.etcd.run(self.catch_up(), timeout=30.0)
            if self.token() and not readonly:  # as SQLite's writer does when it opens
                self.etcd.run(self._prune_now_and_then(), timeout=30.0)
        except (EtcdError, TimeoutError) as exc:
            said = (
                f"--etcd {etcd.settings.endpoints}: cannot read the verdict history ({exc}); "
                "check that etcd runs and that the endpoints, TLS and user are right"
            )
            if readonly:
                raise OSError(said) from None
            # A replica (re)started while etcd is away stands by and keeps trying, rather
            # than exit and have its restarts back off for minutes after etcd is back; it
            # leads only once it has read the whole history (Leadership's before_lead).
            log.warning("etcd cannot be read now; standing by until it can", error=said)
            self._failed("read", exc)
        self._refresher = None if readonly else self.etcd.submit(self._refresh_loop())

    @property
    def fenced(self) -> bool:
        return True

    # -- keys --------------------------------------------------------------------------
    def _key(self, job_id: str, round_: int) -> bytes:
        return self.prefix + f"v/{quote(job_id, safe='')}/{round_:012d}".encode()

    def _part_key(self, job_id: str, round_: int, i: int) -> bytes:
        return self.prefix + f"p/{quote(job_id, safe='')}/{round_:012d}/{i:04d}".encode()

    # -- catching up (etcd loop) -------------------------------------------------------
    async def catch_up(self) -> None:
        """Read every verdict stored since the last catch-up."""
        start, end = self.prefix + b"v/", prefix_end(self.prefix + b"v/")
        since = self._revision + 1 if self._revision else 0
        revision = 0
        while True:
            reply = await self.etcd.client.range(start, end, min_mod_revision=since, limit=PAGE)
            revision = revision or reply.header.revision
            for kv in reply.kvs:
                self._learn(kv.key, kv.value)
            if not reply.more or not reply.kvs:
                break
            start = reply.kvs[-1].key + b"\0"
        self._revision = max(self._revision, revision)

    def _learn(self, key: bytes, value: bytes) -> None:
        try:
            head = json.loads(value) if value.startswith(b"{") else None
            if head is not None:  # a record in parts: its listing is in the head
                row, parts, packed = VerdictRow(**head["row"]), int(head["parts"]), None
            else:
                row, parts, packed = row_of(value), 0, value
        except (ValueError, KeyError, TypeError, zlib.error) as exc:
            log.warning("unreadable verdict in etcd; skipped", key=key.decode(errors="replace"))
            self._failed("read", exc)
            return
        self._keep(Entry(row, parts, packed))

    def _keep(self, entry: Entry) -> None:
        with self._lock:
            rounds = self._jobs.setdefault(entry.row.job_id, {})
            rounds[entry.row.round] = entry
            self._unpacked.pop((entry.row.job_id, entry.row.round), None)
            newest = sorted(rounds, reverse=True)
            for old in newest[KEEP_RECORDS:]:
                rounds[old].packed = None

    async def _refresh_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(REFRESH_S)
            if self.token():
                await self._prune_now_and_then()
                continue  # the leader wrote every verdict since its catch-up
            try:
                await self.catch_up()
                self._cut_local()
                self._error = ""
            except EtcdError as exc:
                self._failed("read", exc)
            except Exception as exc:  # a bug: logged whole, and the loop goes on
                log.exception("etcd history refresh error; retried")
                self._failed("read", exc)

    async def _prune_now_and_then(self) -> None:
        if time.monotonic() - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = time.monotonic()
        cutoff = time.time() - self.retention_s
        old = [
            (e.row.job_id, e.row.round, e.parts)
            for e in self._entries()
            if e.row.decided_at < cutoff
        ]
        try:
            for job, round_, parts in old:
                await self.etcd.client.delete(self._key(job, round_))
                if parts:
                    first = self._part_key(job, round_, 0)
                    await self.etcd.client.delete(first, prefix_end(first[:-4]))
            await self._prune_audits(cutoff)
        except EtcdError as exc:
            self._failed("prune", exc)
        self._cut_local()
        if old:
            log.info("verdicts past the retention deleted from etcd", count=len(old))

    async def _prune_audits(self, cutoff: float) -> None:
        """Audit findings past the retention: their keys end in their time, so per job
        everything below the cutoff's key goes."""
        start = self.prefix + b"a/"
        reply = await self.etcd.client.range(start, prefix_end(start), keys_only=True)
        jobs = {kv.key.rsplit(b"/", 1)[0] + b"/" for kv in reply.kvs}
        for job in jobs:
            await self.etcd.client.delete(job, job + f"{int(cutoff * 1e9):020d}".encode())

    def _cut_local(self) -> None:
        cutoff = time.time() - self.retention_s
        with self._lock:
            for job in list(self._jobs):
                rounds = self._jobs[job]
                for r in [r for r, e in rounds.items() if e.row.decided_at < cutoff]:
                    del rounds[r]
                if not rounds:
                    del self._jobs[job]

    def _entries(self) -> list[Entry]:
        with self._lock:
            return [e for rounds in self._jobs.values() for e in rounds.values()]

    # -- writing (etcd loop) -----------------------------------------------------------
    def record(self, row: VerdictRow, written: Callable[[], None] | None = None) -> None:
        """Store `row` under the fence; `written` once it is (on the etcd thread). A write
        that fails (this replica no longer leads, or etcd refuses it) steps the replica
        down: the verdict is not stored and must not be sent."""
        if self.readonly:
            raise OSError("the etcd history is open read-only")
        with self._lock:
            self._pending += 1
        self.etcd.submit(self._write(row, written))

    async def _write(self, row: VerdictRow, written: Callable[[], None] | None) -> None:
        try:
            packed = pack(row)
            parts = await self._stored(row, packed)
            if parts is None:
                return
            self._error = ""
            self._keep(Entry(replace(row, members={}, verdict=None), parts, packed))
            if written is not None:
                written()
        finally:
            with self._lock:
                self._pending -= 1

    async def _stored(self, row: VerdictRow, packed: bytes) -> int | None:
        """Store under the fence, retried on etcd errors while this replica leads; in how
        many parts (None: not stored, and the replica stepped down)."""
        for attempt in range(WRITE_TRIES):
            token = self.token()
            if not token:
                self._lost("this replica no longer leads; the verdict was not stored")
                return None
            try:
                parts = await self._fenced_put(row, packed, token)
            except EtcdError as exc:
                self._failed("write", exc)
                if attempt == WRITE_TRIES - 1:
                    self._lost(f"the verdict could not be stored in etcd: {exc}")
                    return None
                await asyncio.sleep(0.2)
                continue
            if parts is None:
                self._lost("the leader key is no longer this replica's, or the round was stored")
            return parts
        return None

    async def _fenced_put(self, row: VerdictRow, packed: bytes, token: int) -> int | None:
        """The record stored under the fence: in how many parts (None: the fence failed)."""
        key = self._key(row.job_id, row.round)
        value, parts = packed, []
        if len(packed) > PART_BYTES:
            parts = [packed[i : i + PART_BYTES] for i in range(0, len(packed), PART_BYTES)]
            if len(parts) > MAX_PARTS:
                raise EtcdError(f"a verdict record of {len(packed)} bytes is over the bound")
            for i, part in enumerate(parts):
                await self.etcd.client.put(self._part_key(row.job_id, row.round, i), part)
            value = json.dumps({"row": listing(row), "parts": len(parts)}).encode()
        # Fenced, and never over another verdict of the round (one round, one verdict).
        reply = await self.etcd.client.txn(
            [created_at(self.leader_key, token), created_at(key, 0)], [put_op(key, value)]
        )
        return len(parts) if reply.succeeded else None

    async def _parts(self, job_id: str, round_: int, parts: int) -> bytes:
        first = self._part_key(job_id, round_, 0)
        reply = await self.etcd.client.range(first, prefix_end(first[:-4]))
        chunks = sorted((kv.key, kv.value) for kv in reply.kvs)
        if len(chunks) != parts:
            raise EtcdError(f"verdict {job_id}/{round_}: {len(chunks)} of {parts} parts")
        return b"".join(v for _, v in chunks)

    async def _head(self, job_id: str, round_: int) -> bytes | None:
        reply = await self.etcd.client.range(self._key(job_id, round_))
        return reply.kvs[0].value if reply.kvs else None

    async def _load(self, entry: Entry) -> bytes:
        """The packed record of `entry`, from etcd (old, or in parts)."""
        row = entry.row
        if entry.parts:
            return await self._parts(row.job_id, row.round, entry.parts)
        value = await self._head(row.job_id, row.round)
        if value is None:
            raise EtcdError(f"verdict {row.job_id}/{row.round} is no longer in etcd")
        return value

    def _failed(self, op: str, exc: Exception) -> None:
        if str(exc) != self._error:  # logged when it changes: an outage is one line
            log.warning("etcd history " + op + " failed", error=str(exc))
        self._error = str(exc)
        for listener in self.listeners:
            listener(op, exc)

    # -- reading (any thread; never waits on etcd but for an old record) ---------------
    @property
    def problem(self) -> str:
        return self._error

    @property
    def spooled(self) -> int:
        with self._lock:
            return self._pending

    def _record_of(self, entry: Entry) -> tuple[str | None, str]:
        """(the verdict's JSON, its members' text): unpacked once for the last UNPACKED
        records read (a failover's re-joining ranks each look their verdict up), read from
        etcd only for a record not held (an old round, or one in parts)."""
        key = (entry.row.job_id, entry.row.round)
        with self._lock:
            body = self._unpacked.get(key)
            if body is not None:
                self._unpacked.move_to_end(key)
                return body
        packed = entry.packed
        if packed is None:
            try:
                packed = self.etcd.run(self._load(entry), timeout=READ_WAIT_S)
            except (EtcdError, TimeoutError) as exc:
                raise Unavailable(
                    f"the verdict history in etcd cannot be read now ({exc}); retry"
                ) from None
        body = Entry(entry.row, 0, packed).unpacked()
        with self._lock:
            self._unpacked[key] = body
            while len(self._unpacked) > UNPACKED:
                self._unpacked.popitem(last=False)
        return body

    def get(self, job_id: str, round_: int = 0) -> VerdictRow | None:
        with self._lock:
            rounds = self._jobs.get(job_id, {})
            entry = rounds.get(round_ or max(rounds, default=0))
        if entry is None:
            return None
        _, members = self._record_of(entry)
        return replace(entry.row, members=members_from_text(members))

    def recent(self, limit: int = 20, job_id: str = "") -> list[VerdictRow]:
        if job_id:
            with self._lock:
                entries = list(self._jobs.get(job_id, {}).values())
        else:
            entries = self._entries()
        entries.sort(key=lambda e: e.row.decided_at, reverse=True)
        return [e.row for e in entries[:limit]]

    def verdict_of(self, job_id: str, incarnation: str, rounds: int = 4) -> Verdict | None:
        with self._lock:
            held = self._jobs.get(job_id, {})
            newest = [held[r] for r in sorted(held, reverse=True)[:rounds]]
        for entry in newest:
            try:
                record, members = self._record_of(entry)
            except Unavailable as exc:
                self._failed("read", exc)
                continue
            if record and received(members, incarnation):
                return verdict_from_json(record)
        return None

    def last_round(self, job_id: str) -> int:
        with self._lock:
            return max(self._jobs.get(job_id, {}), default=0)

    # -- audit findings: `<prefix>a/<job>/<at in ns>`, JSON; written by the leader --------
    def _audit_key(self, job_id: str, at: float = -1.0) -> bytes:
        job = self.prefix + f"a/{quote(job_id, safe='')}/".encode()
        return job if at < 0 else job + f"{int(at * 1e9):020d}".encode()

    def record_audit(self, finding: AuditFinding) -> None:
        if self.readonly:
            raise OSError("the etcd history is open read-only")
        with self._lock:
            self._pending += 1
            self._queued_audits.append(finding)
        self.etcd.submit(self._write_audit(finding))

    async def _write_audit(self, finding: AuditFinding) -> None:
        try:
            value = json.dumps(asdict(finding)).encode()
            await self.etcd.client.put(self._audit_key(finding.job_id, finding.at), value)
        except EtcdError as exc:
            self._failed("write", exc)
        finally:
            with self._lock:
                self._pending -= 1
                self._queued_audits.remove(finding)

    def audits(self, job_id: str, limit: int = 200) -> list[AuditFinding]:
        """Read from etcd (at most READ_WAIT_S: audits are read once per cohort, on its first
        audit after a restart, and by `explain --audits`)."""
        start = self._audit_key(job_id)
        with self._lock:
            queued = [f for f in self._queued_audits if f.job_id == job_id]

        async def read() -> list[AuditFinding]:
            reply = await self.etcd.client.range(start, prefix_end(start))
            return [AuditFinding(**json.loads(kv.value)) for kv in reply.kvs]

        try:
            return with_queued(self.etcd.run(read(), timeout=READ_WAIT_S), queued, limit)
        except (EtcdError, TimeoutError, ValueError, TypeError) as exc:
            self._failed("read", exc)
            raise Unavailable(
                f"the audit history in etcd cannot be read now ({exc}); retry"
            ) from None

    def flush(self, timeout: float = 5.0) -> bool:
        give_up = time.monotonic() + timeout
        while self.spooled and time.monotonic() < give_up:
            time.sleep(0.01)
        return not self.spooled

    def close(self) -> None:
        self._closing = True
        self.flush(2.0)
        if self._refresher is not None:
            self._refresher.cancel()
