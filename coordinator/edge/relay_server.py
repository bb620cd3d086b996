"""`cohortgate relay`'s server: the Relay servicer (relay.py) on its own port, with TLS,
health and keepalive, until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from cohortgate.coordinator.codec.channel import ClientSecurity
from cohortgate.coordinator.contract.limits import Limits
from cohortgate.coordinator.edge.exposure import ServerTLS, exposed
from cohortgate.coordinator.edge.plumbing import RAW_CHUNKS, add_service, keepalive_server_options
from cohortgate.coordinator.edge.ports import bind
from cohortgate.coordinator.edge.relay import Relay
from cohortgate.coordinator.edge.relay_audits import WINDOW_S as AUDIT_WINDOW_S

log = structlog.get_logger("cohortgate.relay")


# The rank grace when neither --rank-grace nor the upstream says one.
DEFAULT_RANK_GRACE_S = 15.0
# How long a relay starting without --rank-grace waits for its upstream to say its grace
# before serving with the default (it keeps asking, every --settings-every seconds).
FIRST_ASK_S = 3.0


async def serve_relay(
    upstream: str,
    listen: str,
    *,
    window_s: float = 2.0,
    audit_window_s: float = AUDIT_WINDOW_S,
    local_ranks: int = 8,
    port_file: str | None = None,
    max_message_bytes: int = Limits.max_message_bytes,
    rank_grace_s: float | None = None,
    settings_every_s: float = 30.0,
    poll: bool = False,
    tls: ServerTLS | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT. `rank_grace_s` None: the upstream's grace governs
    (one setting for the tree), asked at start and every `settings_every_s`; when it
    changes the server restarts with it (its ranks' calls end and the agents re-join)."""
    tls = tls or ServerTLS()
    relay = Relay(
        upstream,
        ClientSecurity.from_env(),
        window_s=window_s,
        audit_window_s=audit_window_s,
        local_ranks=local_ranks,
        max_message_bytes=max_message_bytes,
        rank_grace_s=rank_grace_s or DEFAULT_RANK_GRACE_S,
        poll=poll,
    )
    if rank_grace_s is None:
        told = await relay.upstream_grace(FIRST_ASK_S)
        relay.rank_grace_s = told or DEFAULT_RANK_GRACE_S
    server, health, port = await start_server(relay, listen, max_message_bytes, tls)
    if port_file:
        with open(port_file, "w") as f:
            f.write(f"{port}\n0\n")
    if exposed(listen) and not tls.on:
        log.warning(
            "serving a non-loopback address without TLS",
            listen=listen,
            advice="every rank's token crosses the network in clear and anyone who reaches "
            "the port can join its ranks' jobs; see --tls-cert/--tls-key "
            "(COHORTGATE_RELAY_TLS_CERT/_KEY)",
        )
    log.info(
        "relaying",
        listen=f"{listen.rpartition(':')[0]}:{port}",
        upstream=upstream,
        local_ranks=local_ranks,
        window_s=window_s,
        rank_grace_s=relay.rank_grace_s,
        rank_grace_from="--rank-grace" if rank_grace_s is not None else "upstream",
        tls=tls.mode,
        pid=os.getpid(),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = f"{listen.rpartition(':')[0]}:{port}"
    fixed = rank_grace_s is not None
    while not await _stopped_or_changed(stop, relay, None if fixed else settings_every_s):
        was, relay.rank_grace_s = relay.rank_grace_s, relay.told_grace
        log.info(
            "the upstream's rank grace changed: the relay's server restarts with it",
            was_s=was,
            now_s=relay.rank_grace_s,
        )
        await health.enter_graceful_shutdown()
        await server.stop(0.5)
        server, health, _ = await start_server(relay, bound, max_message_bytes, tls)
        # Ranks that joined during the restart were refused (UNAVAILABLE: the agent
        # retries); from here they are served again.
        log.info("relaying again", listen=bound, rank_grace_s=relay.rank_grace_s)
    await health.enter_graceful_shutdown()
    await server.stop(2.0)
    await relay.close()


async def start_server(
    relay: Relay, listen: str, max_message_bytes: int, tls: ServerTLS
) -> tuple[grpc.aio.Server, HealthServicer, int]:
    """The relay's server, serving, with keepalive from the relay's rank grace now."""
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 0),  # one relay per address (see server.py)
            ("grpc.max_receive_message_length", max_message_bytes),
            # A dead or frozen rank (SIGSTOP, a hung process: its connection stays open)
            # is dropped within the grace, as the coordinator drops a direct one; the
            # rest of its group re-joins without it. Without this the coordinator pings
            # only the relay, which answers for every rank behind it.
            *keepalive_server_options(relay.rank_grace_s),
        ]
    )
    add_service(server, "CohortService", relay, raw=RAW_CHUNKS)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = bind(server, "--listen", listen, tls.credentials())
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, health, port


async def _stopped_or_changed(stop: asyncio.Event, relay: Relay, every_s: float | None) -> bool:
    """True once asked to stop; False when the upstream's grace (relay.told_grace) differs
    from the one the server runs with. A fixed grace (--rank-grace: `every_s` None) is
    never asked."""
    if every_s is None:
        await stop.wait()
        return True
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every_s)
            return True
        except TimeoutError:
            pass
        told = await relay.upstream_grace(FIRST_ASK_S)
        if told is not None and told != relay.rank_grace_s:
            relay.told_grace = told
            return False
