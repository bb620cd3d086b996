"""Service registration with the wire's serializers: shared by the coordinator and the relay.

Requests that are not valid protobuf become INVALID_ARGUMENT (not grpc's INTERNAL); a verdict
encoded once for all its ranks goes out as bytes. Imports only grpc and the generated stubs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.contract.errors import InvalidArgument


class Malformed:
    """What a request that is not valid protobuf deserialises to (instead of raising)."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.message = f"the request is not a valid {type_name}: {error}"


def parse_request(cls: Any, data: bytes) -> Any:
    """`data` as a `cls` message, or Malformed (for RAW_REQUESTS handlers, off the loop)."""
    return _safe_deserializer(cls)(data)


def parsed(cls: Any, data: bytes, sent: Any = None) -> Any:
    """`data` as a `cls` message, or INVALID_ARGUMENT naming the message `sent` (default
    `cls`: a header read from the front of a larger message names the larger one)."""
    message = parse_request(cls, data)
    if isinstance(message, Malformed):
        raise InvalidArgument(message.message.replace(cls.__name__, (sent or cls).__name__))
    return message


def _safe_deserializer(cls: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Malformed(cls.DESCRIPTOR.full_name, exc)

    return parse


def _serializer(cls: Any) -> Callable[[Any], bytes]:
    """Messages are encoded; bytes (a verdict encoded once for all its ranks) pass as they are."""

    def encode(message: Any) -> bytes:
        return message if isinstance(message, bytes) else bytes(message.SerializeToString())

    return encode


# Methods whose requests carry a large payload (a manifest, a million digests): their
# handlers receive the raw bytes and decide who sent them, and whether the size is allowed,
# before decoding the payload, which they do off the event loop.
RAW_REQUESTS = frozenset({"UploadManifest", "UploadDigests"})
# The coordinator also takes joins as bytes: one with a 100k-piece layout is decoded and
# validated off the loop (small ones, nearly all, inline).
RAW_JOINS = RAW_REQUESTS | {"Join", "JoinGroup", "JoinPoll"}
# A relay passes uploads' chunks upstream as they came, too (and a rank's code files).
RAW_CHUNKS = RAW_REQUESTS | {"UploadManifestChunks", "UploadDigestsChunks", "UploadFiles"}


def _raw(data: bytes) -> bytes:
    return data


def add_service(
    server: grpc.aio.Server,
    service_name: str,
    servicer: Any,
    raw: frozenset[str] = RAW_REQUESTS,
) -> None:
    """Register `servicer` for a cohortgate.v1 service with deserialisers that never raise:
    bytes that are not a protobuf message get INVALID_ARGUMENT, not grpc's INTERNAL. The
    methods named in `raw` get their request as bytes."""
    descriptor = pb.DESCRIPTOR.services_by_name[service_name]
    handlers = {}
    for method in descriptor.methods:
        request_cls = getattr(pb, method.input_type.name)
        parse = _raw if method.name in raw else _safe_deserializer(request_cls)
        handlers[method.name] = _handler(
            method, getattr(servicer, method.name), parse, getattr(pb, method.output_type.name)
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(descriptor.full_name, handlers),)
    )


def _handler(
    method: Any, behavior: Any, parse: Callable[[bytes], Any], response_cls: Any
) -> grpc.RpcMethodHandler:
    """The handler of one method, by its kind: a Malformed request aborts the call."""
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _stream(behavior),
            request_deserializer=parse,
            response_serializer=_serializer(response_cls),
        )
    handler = (
        grpc.stream_unary_rpc_method_handler
        if method.client_streaming
        else grpc.unary_unary_rpc_method_handler
    )
    wrap = _client_stream if method.client_streaming else _unary
    return handler(
        wrap(behavior),
        request_deserializer=parse,
        response_serializer=_serializer(response_cls),
    )


async def _refuse(request: Any, context: Any) -> None:
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _stream(behavior: Any) -> Any:
    async def stream(request: Any, context: Any) -> Any:
        await _refuse(request, context)
        async for item in behavior(request, context):
            yield item

    return stream


def _client_stream(behavior: Any) -> Any:
    async def client_stream(requests: AsyncIterator[Any], context: Any) -> Any:
        async def checked() -> AsyncIterator[Any]:
            async for request in requests:
                await _refuse(request, context)
                yield request

        return await behavior(checked(), context)

    return client_stream


def _unary(behavior: Any) -> Any:
    async def unary(request: Any, context: Any) -> Any:
        await _refuse(request, context)
        return await behavior(request, context)

    return unary


def keepalive_server_options(grace_s: float) -> list[tuple[str, int]]:
    """A server's HTTP/2 keepalive: a peer (a rank, a relay) that does not answer a ping
    within `grace_s` loses its connection, and with it its calls. Shared by `serve` and the
    relay, so a frozen rank is dropped the same way whichever it joined through."""
    half_grace_ms = max(int(grace_s * 500), 1)
    return [
        ("grpc.keepalive_time_ms", half_grace_ms),
        ("grpc.keepalive_timeout_ms", half_grace_ms),
        # grpcio 1.85 waits for a ping's answer `http2.ping_timeout_ms` (60 s by default),
        # not `keepalive_timeout_ms`: a frozen host (SIGSTOP, a hung node: its connection
        # stays open) then held its rank for a minute whatever the grace.
        ("grpc.http2.ping_timeout_ms", half_grace_ms),
        # A waiting rank's call is quiet (no data for minutes): keep pinging it anyway.
        ("grpc.http2.max_pings_without_data", 0),
        # Agents and relays wait minutes on one call; let their keepalive pings through.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_MS),
    ]


# A server takes a client's ping at most this often when no data flows (more often is
# answered with GOAWAY "too many pings"): a client pings no more often than this.
MIN_CLIENT_PING_MS = 5000


def keepalive_client_options(grace_s: float) -> list[tuple[str, int]]:
    """A long-waiting client's channel (a relay's upstream): a server that stops answering
    (a black-holed link, a frozen coordinator, a close that was lost) fails the call with
    UNAVAILABLE within about `grace_s` (at least 5 s: see MIN_CLIENT_PING_MS), instead of
    the call waiting forever on a connection nobody holds any more. Reconnects are tried
    every 0.2-2 s, and a connection attempt that hangs (its handshake black-holed) gives up
    after 2 s, so the link is back within seconds of healing."""
    ping_ms = max(int(grace_s * 500), MIN_CLIENT_PING_MS)
    answer_ms = max(int(grace_s * 500), 1000)
    return [
        ("grpc.keepalive_time_ms", ping_ms),
        ("grpc.keepalive_timeout_ms", answer_ms),
        ("grpc.http2.ping_timeout_ms", answer_ms),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.initial_reconnect_backoff_ms", 200),
        # Also the least time a connection attempt is given (grpc's min_connect_timeout).
        ("grpc.min_reconnect_backoff_ms", 1000),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]
