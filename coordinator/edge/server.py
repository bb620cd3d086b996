"""Server assembly: the cohort service, gRPC health and reflection, signals, graceful stop."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import sys
from collections.abc import Callable

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.edge.auth import Auth, TokenStore
from cohortgate.coordinator.edge.config import ServeConfig
from cohortgate.coordinator.edge.exposure import unprotected
from cohortgate.coordinator.edge.http import MetricsServer
from cohortgate.coordinator.edge.plumbing import RAW_JOINS, add_service, keepalive_server_options
from cohortgate.coordinator.edge.ports import BindError, bind, check_free
from cohortgate.coordinator.edge.replica import Replica
from cohortgate.coordinator.edge.servicer import CohortServicer
from cohortgate.coordinator.edge.status_servicer import StatusServicer
from cohortgate.coordinator.service.core import Coordinator
from cohortgate.coordinator.service.metrics import Metrics
from cohortgate.coordinator.service.observers import Observer
from cohortgate.coordinator.state.backends import open_verdicts

log = structlog.get_logger("cohortgate")

# Calls grpc core may hold before the Python server accepts them (see start()).
PENDING_CALLS = 1 << 20

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["CohortService"].full_name
STATUS_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["StatusService"].full_name
# The health name of the verdict history: NOT_SERVING while its file refuses writes.
HISTORY_HEALTH = "cohortgate.history"
HISTORY_CHECK_S = 1.0


class RunningServer:
    """A started server: its bound ports, and how to stop it."""

    def __init__(
        self,
        server: grpc.aio.Server,
        coordinator: Coordinator,
        health: HealthServicer,
        port: int,
        metrics: MetricsServer | None,
    ) -> None:
        self.server = server
        self.coordinator = coordinator
        self.health = health
        self.port = port
        self.metrics = metrics
        self.metrics_port = metrics.port if metrics else 0
        self.tasks: list[asyncio.Task[None]] = []
        self.replica: Replica | None = None

    async def stop(self, grace: float) -> None:
        for task in self.tasks:
            task.cancel()
        await self.health.enter_graceful_shutdown()
        self.coordinator.close()
        if self.replica is not None:  # the lead goes to a standby now, not after the grace
            await asyncio.to_thread(self.replica.resign)
        await self.server.stop(grace)
        if self.metrics is not None:
            await self.metrics.stop()
        if self.replica is not None:
            await asyncio.to_thread(self.replica.close)
            return
        self.coordinator.history.close()


def _auth(config: ServeConfig) -> Auth:
    if config.tokens_file is None:
        return Auth(None)
    tokens = TokenStore.load(config.tokens_file)
    said = TokenStore.exposure(config.tokens_file)
    if said:
        log.warning(said)
    return Auth(tokens)


async def start(config: ServeConfig, coordinator: Coordinator | None = None) -> RunningServer:
    # (exposure, TLS files and policies were checked when `config` was built)
    # Before anything else: a second coordinator on a held address must stop here, in
    # one line, not share the port (gRPC's SO_REUSEPORT) and split a job's ranks.
    check_free("--listen", config.listen)
    if config.metrics_listen != "off":
        check_free("--metrics-listen", config.metrics_listen)
    auth = _auth(config)
    limits = config.limits
    replica = None
    if coordinator is None:
        coordinator, replica = _coordinator(config)
    server = grpc.aio.server(
        options=[
            # One process per address: with SO_REUSEPORT (gRPC's Linux default) a second
            # coordinator would take half the connections of the first.
            ("grpc.so_reuseport", 0),
            # No one message may hold the event loop long (see Limits.max_message_bytes);
            # a larger one is refused by grpc core, off the loop, as it arrives.
            ("grpc.max_receive_message_length", limits.max_message_bytes),
            # Answers (a verdict, a listing) are encoded once and bounded by their own caps.
            ("grpc.max_send_message_length", max(limits.max_upload_bytes, 64 << 20)),
            # A dead or frozen rank's connection (with its join) is dropped within the
            # grace: HTTP/2 keepalive pings every grace/2, answered within grace/2.
            *keepalive_server_options(config.rank_grace),
            # A whole job joins at once. grpc core queues calls the Python server has not
            # picked up yet and, past 1,000 of them (or after some time queued), cancels
            # the newest; thousands of ranks then never reach the coordinator. Let the
            # queue hold every rank the limits allow, for as long as a join may wait.
            ("grpc.server.max_pending_requests", PENDING_CALLS),
            ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS),
            ("grpc.server_max_unrequested_time_in_server", 600),
        ]
    )
    servicer = CohortServicer(coordinator, auth, limits, config.rank_grace)
    add_service(server, "CohortService", servicer, RAW_JOINS)
    add_service(server, "StatusService", StatusServicer(coordinator, auth))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (
            SERVICE_NAME,
            STATUS_SERVICE_NAME,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    credentials = config.tls.credentials()
    port = bind(server, "--listen", config.listen, credentials)
    metrics = None
    if config.metrics_listen != "off":
        try:
            metrics = MetricsServer(
                coordinator, config.metrics_listen, auth, config.tls.ssl_context()
            )
            await metrics.start()
        except OSError as exc:
            check_free("--metrics-listen", config.metrics_listen)  # names the holder
            raise BindError(f"--metrics-listen {config.metrics_listen}: {exc.strerror}") from None
    await server.start()
    for name in ("", SERVICE_NAME, STATUS_SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    running = RunningServer(server, coordinator, health, port, metrics)
    if replica is not None:  # stands by (CohortService NOT_SERVING) until it leads
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        advertise = config.advertise or f"{config.advertised.rpartition(':')[0]}:{port}"
        replica.start(coordinator, health, SERVICE_NAME, advertise)
        running.replica = replica
    running.tasks.append(asyncio.create_task(_sweep(coordinator, config.job_retention)))
    await health.set(HISTORY_HEALTH, health_pb2.HealthCheckResponse.SERVING)
    running.tasks.append(asyncio.create_task(_watch_history(coordinator, health)))
    missing = unprotected(config.tls_cert is not None, auth.enabled)
    if config.exposed and missing:
        log.warning(
            "serving a non-loopback address without " + missing,
            advice="anyone who reaches the port can join, read or disturb cohorts; see "
            "--tls-cert/--tls-key and --tokens-file",
        )
    if config.port_file is not None:
        config.port_file.write_text(f"{port}\n{running.metrics_port}\n")
    host = config.listen.rpartition(":")[0]
    log.info(
        "serving",
        listen=f"{host}:{port}",
        metrics=f"{config.metrics_listen.rpartition(':')[0]}:{running.metrics_port}"
        if metrics
        else "off",
        history=("etcd " + config.etcd) if config.etcd else (config.history_path or "off"),
        join_deadline_s=config.join_deadline,
        pid=os.getpid(),
    )
    return running


def _coordinator(config: ServeConfig) -> tuple[Coordinator, Replica | None]:
    """The service over its stores: the verdict history in SQLite (--history), or in etcd
    with this process as one replica of several (--etcd)."""
    metrics = Metrics()
    replica = None
    etcd = config.etcd_settings
    if etcd is not None:
        if "history" in config.model_fields_set:
            log.warning(
                "--history is not used with --etcd: the verdict history is kept in etcd",
                history=config.history,
            )
        replica = Replica(
            etcd,
            ttl_s=config.leader_ttl,
            retention_days=config.history_retention_days,
            metrics=metrics,
        )
        history = replica.history
    else:
        history = open_verdicts(config.history_path, retention_days=config.history_retention_days)
    observer = Observer(metrics)
    if replica is not None:
        observer.replica = replica.snapshot
    coordinator = Coordinator(
        config.formation,
        progress_interval_s=config.progress_interval,
        watch_interval_s=config.watch_interval,
        observer=observer,
        history=history,
        limits=config.limits,
    )
    return coordinator, replica


async def _sweep(coordinator: Coordinator, retention_s: float) -> None:
    """Forget decided jobs past their retention, so memory stays flat job after job."""
    while True:
        await asyncio.sleep(min(max(retention_s / 2, 0.5), 60.0))
        evicted = coordinator.store.evict(retention_s)
        if evicted:
            log.debug("forgot decided jobs", count=evicted)


async def _watch_history(coordinator: Coordinator, health: HealthServicer) -> None:
    """Health names a history that refuses writes: NOT_SERVING for HISTORY_HEALTH (the
    coordinator itself stays SERVING: verdicts do not depend on the record)."""
    was = ""
    while True:
        problem = coordinator.history_problem()
        if problem != was:
            status = health_pb2.HealthCheckResponse
            await health.set(HISTORY_HEALTH, status.NOT_SERVING if problem else status.SERVING)
            if problem:
                log.warning("history degraded", problem=problem)
            else:
                log.info("history writes again")
            was = problem
        await asyncio.sleep(HISTORY_CHECK_S)


async def serve(config: ServeConfig, on_ready: Callable[[int], None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully."""
    # Worker threads (decoding a large upload or join) hand the GIL back to the event loop
    # every millisecond, not every 5: gRPC health stays fast while they run.
    sys.setswitchinterval(0.001)
    # A collection walks every tracked object with the GIL held: with a million layout
    # pieces or manifest entries alive, the default thresholds (700 allocations) ran one
    # every few milliseconds of a large decode. Collect rarely; what start-up made, never.
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
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
