"""A gRPC hop in a test: every CohortService call passes through as raw bytes to the
upstream and back, on the test process's shared loop, and each JoinGroup / JoinPoll and Audit
request is kept as sent. With `older=True` it plays a coordinator that predates rank classes:
the `ranks` field of a group is dropped on the way up, as an older protobuf parser skips a
field it does not know; `older="empty"` drops the members too (an upstream that reads every
group as empty). `to_cut = n`: the next n JoinGroup streams end cleanly (status OK)
after their first answer, as a middlebox that caps a stream's age or a peer that closes it
may."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from tests.helpers import run_async

SERVICE = pb.DESCRIPTOR.services_by_name["CohortService"]
GROUPS = ("JoinGroup", "JoinPoll")


def _metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    """The caller's metadata (its token), passed on."""
    return tuple((k, v) for k, v in context.invocation_metadata() or () if not k.startswith(":"))


class GrpcProxy:
    def __init__(self, upstream: str, *, older: bool | str = False) -> None:
        self.upstream = upstream
        self.older = older
        self.groups: list[pb.JoinGroupRequest] = []  # as they arrived, before any change
        self.methods: list[str] = []  # the method each of `groups` came by
        self.audits: list[pb.AuditRequest] = []
        self.to_cut = 0  # JoinGroup streams still to end cleanly after their first answer
        self.port = run_async(self._start(), timeout=30)
        self.addr = f"127.0.0.1:{self.port}"

    async def _start(self) -> int:
        self.channel = grpc.aio.insecure_channel(self.upstream)
        self.server = grpc.aio.server()
        handlers = {m.name: self._handler(m) for m in SERVICE.methods}
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
        )
        port: int = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def _up(self, name: str, data: bytes) -> bytes:
        if name == "Audit":
            self.audits.append(pb.AuditRequest.FromString(data))
        if name in GROUPS:
            self.groups.append(pb.JoinGroupRequest.FromString(data))
            self.methods.append(name)
            if self.older:
                group = pb.JoinGroupRequest.FromString(data)
                group.ClearField("ranks")
                if self.older == "empty":
                    group.ClearField("members")
                return group.SerializeToString()
        return data

    def _handler(self, method: Any) -> grpc.RpcMethodHandler:
        path = f"/{SERVICE.full_name}/{method.name}"
        if method.client_streaming:
            return grpc.stream_unary_rpc_method_handler(self._stream_in(path))
        if method.server_streaming:
            return grpc.unary_stream_rpc_method_handler(self._stream_out(path, method.name))
        return grpc.unary_unary_rpc_method_handler(self._unary(path, method.name))

    def _stream_in(self, path: str) -> Any:
        async def stream_in(chunks: AsyncIterator[bytes], context: Any) -> bytes:
            try:
                return await self.channel.stream_unary(path)(chunks, metadata=_metadata(context))  # type: ignore[no-any-return]
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
                raise

        return stream_in

    def _stream_out(self, path: str, name: str) -> Any:
        async def stream_out(data: bytes, context: Any) -> AsyncIterator[bytes]:
            call = self.channel.unary_stream(path)(
                self._up(name, data), metadata=_metadata(context)
            )
            # A caller that goes away ends the call upstream too, as a real hop's closed
            # connection does (grpc.aio does not always cancel this handler; the context's
            # done callback always runs): else the coordinator holds the caller's ranks.
            context.add_done_callback(lambda _: call.cancel())
            cut = name == "JoinGroup" and self.to_cut > 0
            self.to_cut -= cut
            try:
                async for reply in call:
                    yield reply
                    if cut:
                        return  # status OK, without the verdict
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
            finally:
                call.cancel()

        return stream_out

    def _unary(self, path: str, name: str) -> Any:
        async def unary(data: bytes, context: Any) -> bytes:
            try:
                return await self.channel.unary_unary(path)(  # type: ignore[no-any-return]
                    self._up(name, data), metadata=_metadata(context)
                )
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
                raise

        return unary

    def sent(self) -> list[str]:
        """How each group came: "classes", "members" or "both"."""
        return [
            "both" if g.members and g.ranks else "classes" if g.ranks else "members"
            for g in self.groups
        ]

    def reroute(self, upstream: str) -> None:
        """From now on, calls go to `upstream` (a coordinator restarted elsewhere)."""

        async def reroute() -> None:
            old, self.channel = self.channel, grpc.aio.insecure_channel(upstream)
            self.upstream = upstream
            await old.close()

        run_async(reroute(), timeout=30)

    def stop(self) -> None:
        async def stop() -> None:
            await self.server.stop(0.5)
            await self.channel.close()

        run_async(stop(), timeout=30)
