"""A relay in the test process (on the shared loop, as InProcessCoordinator is): the relay's
code runs where a mutation run sees it. test_relays.py runs relays as the processes users
start; test_relay_inprocess.py runs the same paths here."""

from __future__ import annotations

from typing import Any

from cohortgate.coordinator.codec.channel import ClientSecurity
from cohortgate.coordinator.edge.exposure import ServerTLS
from cohortgate.coordinator.edge.relay import Relay
from cohortgate.coordinator.edge.relay_server import start_server
from tests.helpers import run_async


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
