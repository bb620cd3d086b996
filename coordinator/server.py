"""Server assembly: the cohort service, gRPC health and reflection, signals, graceful stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from coordinator.api.v1 import cohort_pb2 as pb
from coordinator.api.v1 import cohort_pb2_grpc as pb_grpc
from coordinator.config import ServeConfig
from coordinator.service import Coordinator
from coordinator.servicer import CohortServicer

log = structlog.get_logger("cohortgate")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CohortService"].full_name
# A 100k-entry manifest is ~10 MB on the wire; 64 MiB leaves room and still bounds memory.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class RunningServer:
    """A started server: its bound port, and how to stop it."""

    def __init__(
        self, server: grpc.aio.Server, coordinator: Coordinator, health: HealthServicer, port: int
    ) -> None:
        self.server = server
        self.coordinator = coordinator
        self.health = health
        self.port = port

    async def stop(self, grace: float) -> None:
        await self.health.enter_graceful_shutdown()
        self.coordinator.close()
        await self.server.stop(grace)


async def start(config: ServeConfig, coordinator: Coordinator | None = None) -> RunningServer:
    config.check_exposure()
    coordinator = coordinator or Coordinator(
        config.formation, progress_interval_s=config.progress_interval
    )
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # Agents wait minutes on one call; let their keepalive pings through.
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ]
    )
    pb_grpc.add_CohortServiceServicer_to_server(CohortServicer(coordinator), server)
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"could not bind {config.listen}: is the port in use?")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.port_file is not None:
        config.port_file.write_text(f"{port}\n")
    host = config.listen.rpartition(":")[0]
    log.info("serving", listen=f"{host}:{port}", join_deadline_s=config.join_deadline)
    return RunningServer(server, coordinator, health, port)


async def serve(config: ServeConfig, on_ready: Callable[[int], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully."""
    running = await start(config)
    if on_ready is not None:
        on_ready(running.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down", grace_s=config.grace)
    await running.stop(config.grace)
