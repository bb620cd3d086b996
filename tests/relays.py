"""A relay in the test process (on the shared loop, as InProcessCoordinator is): the relay's
code runs where a mutation run sees it. test_relays.py runs relays as the processes users
start; test_relay_inprocess.py runs the same paths here."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from cohortgate.coordinator.codec.channel import ClientSecurity
from cohortgate.coordinator.edge.exposure import ServerTLS
from cohortgate.coordinator.edge.relay import Relay
from cohortgate.coordinator.edge.relay_server import start_server
from tests.grpc_proxy import GrpcProxy
from tests.helpers import InProcessCoordinator, run_async


class InProcessRelay:
    """`cohortgate relay --upstream UPSTREAM --listen 127.0.0.1:0` with `settings` (Relay's
    keyword arguments: window_s, local_ranks, max_message_bytes, rank_grace_s, poll);
    `security`: how it reaches its upstream (COHORTGATE_TLS_*), `tls`: its own port's."""

    def __init__(
        self,
        upstream: str,
        security: ClientSecurity | None = None,
        tls: ServerTLS | None = None,
        **settings: Any,
    ) -> None:
        async def started() -> tuple[Relay, Any, int]:
            relay = Relay(upstream, security or ClientSecurity(), **settings)
            server, _, port = await start_server(
                relay, "127.0.0.1:0", relay.max_message_bytes, tls or ServerTLS()
            )
            return relay, server, port

        self.relay, self._server, port = run_async(started(), timeout=30)
        self.addr = f"127.0.0.1:{port}"

    def stop(self) -> None:
        async def stopped() -> None:
            await self._server.stop(0.5)
            await self.relay.close()

        run_async(stopped(), timeout=30)


class RelayedNode:
    """A coordinator (`coordinator`'s settings), the gRPC hop that keeps what the relay
    sends it (`hop`; `older`: it plays an upstream older than rank classes), and the node's
    relay (`relay`'s settings) in front of it (`addr`)."""

    def __init__(
        self, coordinator: dict[str, Any], older: bool | str = False, **relay: Any
    ) -> None:
        self.coordinator = InProcessCoordinator(**coordinator)
        self.hop = GrpcProxy(self.coordinator.addr, older=older)
        self.relay = InProcessRelay(self.hop.addr, **relay)
        self.addr = self.relay.addr

    def stop(self) -> None:
        self.relay.stop()
        self.hop.stop()
        self.coordinator.stop()


def audit_step(
    relay_of: Callable[[int], str], audits: dict[int, pb.RankAudit]
) -> dict[int, pb.AuditReply | grpc.RpcError]:
    """Each rank's audit through its node relay (`relay_of(rank)`'s address), all at once, as
    a DDP step's ranks send them: each rank's answer, or its error."""
    channels = {r: grpc.insecure_channel(relay_of(r)) for r in audits}
    start = threading.Barrier(len(audits))

    def one(rank: int) -> pb.AuditReply | grpc.RpcError:
        stub = pb_grpc.CohortServiceStub(channels[rank])
        start.wait()
        try:
            reply: pb.AuditReply = stub.Audit(pb.AuditRequest(audits=[audits[rank]]), timeout=30)
            return reply
        except grpc.RpcError as exc:
            return exc

    try:
        with ThreadPoolExecutor(len(audits)) as pool:
            return dict(zip(audits, pool.map(one, audits), strict=True))
    finally:
        for ch in channels.values():
            ch.close()
