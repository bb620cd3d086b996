"""A TCP proxy between two hops (rank, relay, coordinator) that black-holes, delays and resets
their traffic, on loopback: the faults of a flaky network, between real processes."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time


class FaultProxy:
    """Listens on 127.0.0.1:<free port> and forwards every connection to `target`.

    `blackhole()`: bytes in both directions are read and dropped (a partition in which the
    peers' closes and pings are lost too); new connections are accepted and black-holed
    alike. `heal()` forwards again (what was dropped stays lost, as on a partition that
    outlived TCP's retries). `delay(s)` holds every chunk `s` seconds before forwarding.
    `reset()` ends every open connection with a TCP RST; `flap(period, for_s)` does it every
    `period` seconds for `for_s` (a flapping switch port, a NAT table flush) in the
    background, and `flapping` waits for it to end."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.dropping = False
        self.delay_s = 0.0
        self.dropped_bytes = 0
        self.resets = 0
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def blackhole(self) -> None:
        self.dropping = True

    def heal(self) -> None:
        self.dropping = False
        self.delay_s = 0.0

    def delay(self, seconds: float) -> None:
        self.delay_s = seconds

    def reset(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.close()

    def flap(self, period_s: float, for_s: float) -> threading.Thread:
        """Resets every connection every `period_s` for `for_s` seconds, on a thread of its
        own (joined by the caller, or by `close`)."""

        def flapping() -> None:
            until = time.monotonic() + for_s
            while not self._closed.wait(period_s) and time.monotonic() < until:
                self.reset()
                self.resets += 1

        thread = threading.Thread(target=flapping, daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        self.reset()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._pairs.append((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                ready, _, _ = select.select([src], [], [], 0.2)
                if not ready:
                    continue
                data = src.recv(65536)
                if self.dropping:
                    if not data:
                        return  # a close (FIN or RST) is lost with the rest: the peer
                    self.dropped_bytes += len(data)  # never hears it
                    continue
                if not data:
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except (OSError, ValueError):
            if self.dropping:
                return
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
