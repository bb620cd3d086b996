"""An asyncio etcd v3 client on our grpcio: endpoints tried in turn, TLS, user/password
authentication, and a deadline on every call (a hung etcd must fail a call, not hold it).

Why our own and not aetcd: aetcd 1.0.0 works on our grpcio/protobuf, but takes one host
(no endpoint list to fail over between), has no TLS, and sets no deadline unless told; etcd's
KV, lease and auth calls are a few dozen lines on stubs generated from etcd's own messages
(proto/cohortgate/coordinator/etcd/etcd.proto), checked like ours by `make proto-check`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

import grpc

from cohortgate.coordinator.etcd import etcd_pb2 as epb
from cohortgate.coordinator.etcd import etcd_pb2_grpc as epb_grpc

_T = TypeVar("_T")

# One etcd call waits at most this long (a write commits in milliseconds on a healthy
# cluster; a leader election in etcd takes about a second).
CALL_TIMEOUT_S = 2.0


class EtcdError(Exception):
    """etcd could not be reached or refused the call; str() names the endpoint and why."""


def parse_endpoints(spec: str) -> list[tuple[str, bool]]:
    """`http://h1:2379,https://h2:2379` (or bare host:port) -> [(host:port, tls)]."""
    found: list[tuple[str, bool]] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        url = urlsplit(item if "://" in item else f"http://{item}")
        if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/"):
            raise ValueError(
                f"{item!r} is not an etcd endpoint; give http://HOST:PORT or https://HOST:PORT"
            )
        host = f"[{url.hostname}]" if ":" in url.hostname else url.hostname
        found.append((f"{host}:{url.port or 2379}", url.scheme == "https"))
    if not found:
        raise ValueError("no etcd endpoint given; e.g. --etcd http://127.0.0.1:2379")
    return found


@dataclass(frozen=True)
class EtcdSettings:
    endpoints: str
    prefix: str = "/cohortgate/"
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    user: str = ""
    password: str = field(default="", repr=False)
    timeout_s: float = CALL_TIMEOUT_S

    def __post_init__(self) -> None:
        parse_endpoints(self.endpoints)
        if (self.cert is None) != (self.key is None):
            raise ValueError("--etcd-cert and --etcd-key go together: give both or neither")
        if bool(self.user) != bool(self.password):
            raise ValueError("--etcd-user and its password go together: give both or neither")

    @property
    def key_prefix(self) -> bytes:
        return self.prefix.encode()


def prefix_end(prefix: bytes) -> bytes:
    """The range_end that makes a Range cover every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


class Etcd:
    """One channel at a time, to the endpoint that last answered; a call that finds it
    unavailable moves to the next endpoint and fails (the caller retries on its schedule)."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self.endpoints = parse_endpoints(settings.endpoints)
        self._at = 0
        self._channel: grpc.aio.Channel | None = None
        self._token: str = ""
        self._closing: set[asyncio.Future[None]] = set()
        self.kv: epb_grpc.KVStub
        self.lease: epb_grpc.LeaseStub

    @property
    def endpoint(self) -> str:
        return self.endpoints[self._at][0]

    def _credentials(self) -> grpc.ChannelCredentials:
        def read(path: Path | None) -> bytes | None:
            return path.read_bytes() if path is not None else None

        s = self.settings
        return grpc.ssl_channel_credentials(read(s.ca), read(s.key), read(s.cert))

    async def _open(self) -> None:
        if self._channel is not None:
            return
        target, tls = self.endpoints[self._at]
        options = [
            ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.keepalive_time_ms", 2000),
            ("grpc.keepalive_timeout_ms", 2000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if tls or self.settings.ca is not None:
            channel = grpc.aio.secure_channel(target, self._credentials(), options)
        else:
            channel = grpc.aio.insecure_channel(target, options)
        if self.settings.user:  # a channel is used only once its user is authenticated
            try:
                reply = await epb_grpc.AuthStub(channel).Authenticate(
                    epb.AuthenticateRequest(
                        name=self.settings.user, password=self.settings.password
                    ),
                    timeout=self.settings.timeout_s,
                )
            except BaseException:
                await channel.close(grace=None)
                raise
            self._token = reply.token
        self._channel = channel
        self.kv = epb_grpc.KVStub(channel)
        self.lease = epb_grpc.LeaseStub(channel)

    async def _next(self, failed: grpc.aio.Channel | None) -> None:
        """The call on `failed` found it broken: drop it (once, whichever of its calls
        fails first); the next call opens a channel to the next endpoint. The calls still
        on it end as cancelled (call() turns that into EtcdError)."""
        if failed is None or failed is not self._channel:
            return  # dropped already, by another call that failed on it
        self._channel, self._token = None, ""
        self._at = (self._at + 1) % len(self.endpoints)
        # Closed in the background, never awaited here: grpc's close of a channel whose
        # calls are being cancelled was seen to never return (both replicas' leadership
        # loops stuck in it after a hung etcd came back).
        task = asyncio.ensure_future(_close(failed))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _metadata(self) -> Sequence[tuple[str, str]]:
        return (("token", self._token),) if self._token else ()

    async def call(
        self, what: str, rpc: Callable[[Sequence[tuple[str, str]], float], Awaitable[_T]]
    ) -> _T:
        """`rpc(metadata, timeout)` on the current endpoint; EtcdError when it fails."""
        endpoint, channel = self.endpoint, None
        try:
            await self._open()
            channel = self._channel
            # grpc's deadline ends the call; this bounds whatever else an await may do
            return await asyncio.wait_for(
                rpc(self._metadata(), self.settings.timeout_s), self.settings.timeout_s + 1.0
            )
        except TimeoutError:
            await self._next(channel)
            raise EtcdError(
                f"etcd at {endpoint}: {what} failed: no answer in {self.settings.timeout_s:g}s"
            ) from None
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAUTHENTICATED,
                grpc.StatusCode.CANCELLED,
            ):
                await self._next(channel)
            raise EtcdError(
                f"etcd at {endpoint}: {what} failed: {code.name}: {exc.details()}"
            ) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # this task is being cancelled (closing): not etcd's failure
            # the call's channel was closed under it: another call found it broken
            raise EtcdError(f"etcd at {endpoint}: {what} failed: its channel broke") from None
        except (OSError, ValueError) as exc:  # TLS files unreadable, a bad address
            await self._next(channel)
            raise EtcdError(f"etcd at {endpoint}: {what} failed: {exc}") from None

    # -- the calls we use ------------------------------------------------------------------
    async def range(
        self,
        key: bytes,
        range_end: bytes = b"",
        *,
        min_mod_revision: int = 0,
        limit: int = 0,
        keys_only: bool = False,
    ) -> epb.RangeResponse:
        request = epb.RangeRequest(
            key=key,
            range_end=range_end,
            min_mod_revision=min_mod_revision,
            limit=limit,
            keys_only=keys_only,
        )
        return await self.call(
            "range", lambda md, t: self.kv.Range(request, timeout=t, metadata=md)
        )

    async def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        request = epb.PutRequest(key=key, value=value, lease=lease)
        await self.call("put", lambda md, t: self.kv.Put(request, timeout=t, metadata=md))

    async def delete(self, key: bytes, range_end: bytes = b"") -> int:
        request = epb.DeleteRangeRequest(key=key, range_end=range_end)
        reply = await self.call(
            "delete", lambda md, t: self.kv.DeleteRange(request, timeout=t, metadata=md)
        )
        return int(reply.deleted)

    async def txn(
        self,
        compare: Sequence[epb.Compare],
        success: Sequence[epb.RequestOp],
        failure: Sequence[epb.RequestOp] = (),
    ) -> epb.TxnResponse:
        request = epb.TxnRequest(compare=compare, success=success, failure=failure)
        return await self.call("txn", lambda md, t: self.kv.Txn(request, timeout=t, metadata=md))

    async def grant(self, ttl_s: int) -> int:
        request = epb.LeaseGrantRequest(TTL=ttl_s)
        reply = await self.call(
            "lease grant", lambda md, t: self.lease.LeaseGrant(request, timeout=t, metadata=md)
        )
        return int(reply.ID)

    async def keepalive(self, lease_id: int) -> int:
        """Renew the lease once; its TTL now (0: it has expired)."""

        async def renew(md: Sequence[tuple[str, str]], t: float) -> int:
            call = self.lease.LeaseKeepAlive(timeout=t, metadata=md)
            await call.write(epb.LeaseKeepAliveRequest(ID=lease_id))
            reply = await call.read()
            call.cancel()
            if reply is grpc.aio.EOF:
                return 0
            return int(reply.TTL)

        return await self.call("lease keepalive", renew)

    async def revoke(self, lease_id: int) -> None:
        request = epb.LeaseRevokeRequest(ID=lease_id)
        await self.call(
            "lease revoke", lambda md, t: self.lease.LeaseRevoke(request, timeout=t, metadata=md)
        )

    async def close(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await _close(channel)


def put_op(key: bytes, value: bytes, lease: int = 0) -> epb.RequestOp:
    return epb.RequestOp(request_put=epb.PutRequest(key=key, value=value, lease=lease))


def get_op(key: bytes) -> epb.RequestOp:
    return epb.RequestOp(request_range=epb.RangeRequest(key=key))


def delete_op(key: bytes, range_end: bytes = b"") -> epb.RequestOp:
    return epb.RequestOp(request_delete_range=epb.DeleteRangeRequest(key=key, range_end=range_end))


def created_at(key: bytes, revision: int) -> epb.Compare:
    """Holds while `key` exists and is the one created at `revision` (0: while it is absent)."""
    return epb.Compare(
        result=epb.Compare.EQUAL, target=epb.Compare.CREATE, key=key, create_revision=revision
    )


class EtcdThread:
    """etcd's calls run on their own event loop, in a thread of their own: a busy
    coordinator loop never delays a lease renewal, and a hung etcd never holds that loop."""

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.client = Etcd(settings)
        self._thread = threading.Thread(target=self._run, name="cohortgate-etcd", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Awaitable[_T]) -> concurrent.futures.Future[_T]:
        """Run `coro` on the etcd loop (from any thread); `asyncio.wrap_future` to await it."""
        return asyncio.run_coroutine_threadsafe(_awaited(coro), self.loop)

    def run(self, coro: Awaitable[_T], timeout: float) -> _T:
        """Run `coro` on the etcd loop and wait for it here (not on an event loop)."""
        return asyncio.run_coroutine_threadsafe(_awaited(coro), self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        with contextlib.suppress(Exception):  # closing: nothing is left to tell
            self.run(self.client.close(), timeout=2.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=2.0)


async def _awaited(coro: Awaitable[_T]) -> _T:
    return await coro


async def _close(channel: grpc.aio.Channel) -> None:
    """Close `channel`, waiting 2 s at most (what is left is dropped with the channel)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(channel.close(grace=None), 2.0)
