"""This coordinator as one replica of several on etcd (`serve --etcd`): the verdict history
in etcd, leadership on a lease, and what standing by means for the outside world.

A standby keeps gRPC health "" SERVING (liveness: it must not be restarted), sets the
CohortService NOT_SERVING (readiness: a Kubernetes Service sends agents to the leader), and
answers every join with UNAVAILABLE naming the leader's advertised address (NotLeader).
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

import structlog
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from cohortgate.coordinator.contract.errors import NotLeader
from cohortgate.coordinator.etcd.client import EtcdSettings, EtcdThread
from cohortgate.coordinator.etcd.leader import Leadership
from cohortgate.coordinator.service.core import Coordinator
from cohortgate.coordinator.service.metrics import Metrics
from cohortgate.coordinator.state.backends import open_etcd_verdicts
from cohortgate.coordinator.state.base import VerdictStore

log = structlog.get_logger("cohortgate")


class Replica:
    """Opened before the coordinator (its history is the etcd store), started once the
    gRPC server serves (health is set from leadership from then on)."""

    def __init__(
        self, settings: EtcdSettings, *, ttl_s: int, retention_days: float, metrics: Metrics
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.etcd = EtcdThread(settings)
        self.leadership = Leadership(
            self.etcd,
            replica=self.id,
            advertise="",
            ttl_s=ttl_s,
            changed=self._changed,
            before_lead=self._catch_up,
            failed=self._failed,
        )
        try:
            self.history: VerdictStore = open_etcd_verdicts(
                self.etcd,
                retention_days,
                token=self._token,
                lost=self.leadership.lost,
            )
        except OSError:
            self.etcd.close()
            raise
        self.history.listeners.append(self._failed)
        self.metrics.leader.set(0)
        self._coordinator: Coordinator | None = None
        self._health: HealthServicer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._service = ""

    def _token(self) -> int:
        """The fencing token while this replica leads by its own clock too (0: it does not)."""
        return self.leadership.token if self.leadership.leading else 0

    async def _catch_up(self) -> None:
        catch_up = getattr(self.history, "catch_up", None)
        if catch_up is not None:
            await catch_up()

    def _failed(self, operation: str, _: Exception) -> None:
        self.metrics.etcd_errors.labels(operation).inc()

    @property
    def leading(self) -> bool:
        return self.leadership.leading

    @property
    def leader(self) -> str:
        """The leader's advertised address ("" while none is known)."""
        return self.leadership.lead.advertise

    def _gate(self) -> NotLeader | None:
        """While leading: refuse a join once this replica's own clock says the lease may
        have gone, before the etcd thread has stepped it down (a process that was paused
        runs its queued calls first)."""
        return None if self.leadership.leading else self.refusal()

    def refusal(self) -> NotLeader:
        leader = self.leader
        if leader and leader != self.leadership.advertise:
            return NotLeader(
                f"this coordinator is a standby; the leader is at {leader} (the agent "
                "follows it; give agents every replica in COHORTGATE_ADDR=a:7070,b:7070)",
                leader,
            )
        why = self.leadership.problem or self.history.problem or "a failover is under way"
        return NotLeader(f"this coordinator is a standby and no replica leads now ({why}); retry")

    def start(
        self, coordinator: Coordinator, health: HealthServicer, service: str, advertise: str
    ) -> None:
        """Campaign from now on; until this replica leads, it stands by."""
        self._coordinator, self._health, self._service = coordinator, health, service
        self._loop = asyncio.get_running_loop()
        self.leadership.advertise = advertise
        coordinator.stand_by(self.refusal)
        self.leadership.start()

    def _changed(self, leading: bool, why: str) -> None:  # on the etcd thread
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._apply(leading, why)))

    async def _apply(self, leading: bool, why: str) -> None:
        coordinator, health = self._coordinator, self._health
        if coordinator is None or health is None:
            return
        status = health_pb2.HealthCheckResponse
        if leading and self.leadership.leading:
            coordinator.lead(self._gate)
            self.metrics.leader.set(1)
            self.metrics.failovers.inc()
            await health.set(self._service, status.SERVING)
        elif not leading:
            coordinator.stand_by(self.refusal)
            self.metrics.leader.set(0)
            self.metrics.step_downs.labels(why).inc()
            await health.set(self._service, status.NOT_SERVING)

    def snapshot(self) -> dict[str, str]:
        """For the status page and /status.json."""
        return {
            "role": "leader" if self.leading else "standby",
            "replica": self.id,
            "advertise": self.leadership.advertise,
            "leader": self.leader,
            "etcd": self.leadership.problem or self.history.problem,
        }

    def resign(self) -> None:
        """Shutting down: the verdicts being stored are (within 2 s), then the lead is
        handed over (the lease revoked): a standby leads within its next campaign."""
        self.history.flush(2.0)
        self.leadership.close()

    def close(self) -> None:
        self.resign()
        self.history.close()
        self.etcd.close()
