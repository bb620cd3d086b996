"""Leadership on an etcd lease: one replica leads (admits joins, decides, delivers) while it
holds the key `<prefix>leader` under a lease it keeps renewing; the others stand by.

Fencing: the leader's token is the revision at which it created the key. Every verdict is
written in a transaction that holds only while the key is still the one created at that
revision (client.created_at), so a leader that lost the key (its lease expired while it
was paused, partitioned or slow) can store nothing, and sends nothing it did not store.
Before the lease can expire, the leader also stops by its own clock: it leads only until
`renewed + ttl - margin`, measured from when it sent the last renewal that succeeded
(etcd counts the TTL from when it received it, which is later).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from cohortgate.coordinator.etcd.client import EtcdError, EtcdThread, created_at, get_op, put_op

log = structlog.get_logger("cohortgate")


def margin_s(ttl_s: float) -> float:
    """How long before the lease could expire a leader stops on its own: a fifth of the
    TTL, at least half a second (scheduling and clock-rate differences)."""
    return max(0.5, ttl_s / 5)


@dataclass(frozen=True)
class Lead:
    """Who leads, as a standby sees it."""

    replica: str = ""
    advertise: str = ""


class Leadership:
    """Campaigns, renews and steps down on the etcd thread; its state is read from any
    thread. `changed(leading, why)` is called on the etcd thread when this replica starts
    or stops leading (why: lease, fence or shutdown); `before_lead` runs (on the etcd loop)
    after the key is won and before the replica announces it leads: the verdict history
    catches up there."""

    def __init__(
        self,
        etcd: EtcdThread,
        *,
        replica: str,
        advertise: str,
        ttl_s: int = 5,
        changed: Callable[[bool, str], None] = lambda leading, why: None,
        before_lead: Callable[[], Awaitable[None]] | None = None,
        failed: Callable[[str, Exception], None] = lambda op, exc: None,
    ) -> None:
        self.etcd = etcd
        self.key = etcd.settings.key_prefix + b"leader"
        self.replica, self.advertise, self.ttl_s = replica, advertise, ttl_s
        self._changed, self._before_lead, self._failed = changed, before_lead, failed
        self.lease = 0
        self.token = 0  # the leader key's create revision while we lead, else 0
        self.valid_until = 0.0  # monotonic: this replica may act as leader until then
        self.lead = Lead()  # who leads (this replica too), as last read
        self.problem = ""  # the last etcd error ("" while etcd answers)
        self.takeovers = 0
        self._closing = False
        self._task: concurrent.futures.Future[None] | None = None

    @property
    def leading(self) -> bool:
        return self.token != 0 and time.monotonic() < self.valid_until

    def start(self) -> None:
        self._task = self.etcd.submit(self._run())

    # -- the loop on the etcd thread ------------------------------------------------------
    async def _run(self) -> None:
        while not self._closing:
            try:
                if self.token:
                    await self._renew()
                else:
                    await self._campaign()
                if self.problem:
                    log.info("etcd answers again", endpoint=self.etcd.client.endpoint)
                self.problem = ""
            except EtcdError as exc:
                self.problem = str(exc)
                self._failed("leadership", exc)
            except Exception as exc:  # a bug: logged whole, and the loop goes on
                log.exception("leadership loop error; campaigning on")
                self.problem = f"{type(exc).__name__}: {exc}"
                self._failed("leadership", exc)
            self._expire()
            await asyncio.sleep(self._interval())

    def _interval(self) -> float:
        if self.token:  # a renewal every third of the TTL: two may fail before we stop
            return self.ttl_s / 3
        return 0.25 if not self.problem else 1.0  # a standby: a read-only txn each turn

    def _expire(self) -> None:
        """Our own clock says the lease may be gone: stop leading now."""
        if self.token and time.monotonic() >= self.valid_until:
            self._step_down("the lease could not be renewed in time: " + (self.problem or "?"))

    async def _campaign(self) -> None:
        if not self.lease or await self._renewed() is None:
            self.lease = await self.etcd.client.grant(self.ttl_s)
        sent = time.monotonic()
        value = json.dumps({"replica": self.replica, "advertise": self.advertise}).encode()
        reply = await self.etcd.client.txn(
            [created_at(self.key, 0)], [put_op(self.key, value, self.lease)], [get_op(self.key)]
        )
        if reply.succeeded:
            await self._won(reply.header.revision, sent)
            return
        kvs = reply.responses[0].response_range.kvs
        if not kvs:
            return  # deleted meanwhile: the next turn campaigns again
        held = kvs[0]
        self.lead = _lead_of(held.value)
        if held.lease == self.lease and self.lead.replica == self.replica:
            # Ours still (we stopped by our own clock while etcd was away, the lease lived)
            await self._won(held.create_revision, sent)

    async def _won(self, revision: int, sent: float) -> None:
        self.token = revision
        self.valid_until = sent + self.ttl_s - margin_s(self.ttl_s)
        if self._before_lead is not None:
            await self._before_lead()
        if not self.leading:  # catching up took the lease's time: try again
            self._step_down("catching up with the verdict history took too long")
            return
        self.lead = Lead(self.replica, self.advertise)
        self.takeovers += 1
        log.info("leading", replica=self.replica, advertise=self.advertise, token=revision)
        self._changed(True, "")

    async def _renewed(self) -> int | None:
        """Renew the lease; the TTL left, or None when it has expired."""
        ttl = await self.etcd.client.keepalive(self.lease)
        return ttl or None

    async def _renew(self) -> None:
        sent = time.monotonic()
        if await self._renewed() is None:
            self.lease = 0
            self._step_down("the lease expired")
            return
        self.valid_until = sent + self.ttl_s - margin_s(self.ttl_s)

    def _step_down(self, why: str, kind: str = "lease") -> None:
        if not self.token:
            return
        self.token = 0
        self.valid_until = 0.0
        self.lead = Lead()
        log.warning(
            "stepped down", replica=self.replica, why=why, advice="another replica takes over"
        )
        self._changed(False, kind)

    # -- from any thread ------------------------------------------------------------------
    def lost(self, why: str) -> None:
        """A fenced write failed: this replica no longer leads (called on the etcd thread)."""
        self._step_down(why, "fence")

    async def _resign(self) -> None:
        token, lease = self.token, self.lease
        self._step_down("shutting down", "shutdown")
        if lease:
            try:
                await self.etcd.client.revoke(lease)  # the key goes now, not after the TTL
            except EtcdError as exc:
                log.info("lease not revoked; it expires by itself", error=str(exc), token=token)

    def close(self) -> None:
        """Stop campaigning and hand leadership over at once (the lease is revoked)."""
        if self._closing:
            return
        self._closing = True
        if self._task is not None:
            self._task.cancel()
        try:
            self.etcd.run(self._resign(), timeout=3.0)
        except Exception as exc:
            log.info("lease not revoked; it expires by itself", error=str(exc))


def _lead_of(value: bytes) -> Lead:
    try:
        data = json.loads(value)
        return Lead(str(data.get("replica", "")), str(data.get("advertise", "")))
    except (ValueError, AttributeError):
        return Lead()
