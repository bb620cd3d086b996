"""Listening addresses: refuse a held one at start, in one line that names it and its holder."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from pathlib import Path
from typing import Any

from cohortgate.coordinator.contract.addr import split_host_port


class BindError(OSError):
    """An address this process cannot listen on; str() is the one line to print."""


def holder(port: int) -> str | None:
    """'pid N (command)' of a process listening on TCP `port` here, where /proc tells."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and int(local.rpartition(":")[2], 16) == port:
                    inodes.add(f"socket:[{inode}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                    shown = cmd if len(cmd) <= 160 else cmd[:157] + "..."
                    return f"pid {proc.name} ({shown})"
    return "another process"


def check_free(flag: str, addr: str) -> None:
    """Raise BindError when `addr` cannot be listened on: held by another process (gRPC
    would otherwise share it through SO_REUSEPORT, or fail with a generic message), or
    not an address of this host."""
    host, port = split_host_port(addr)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError(f"{flag} {addr}: cannot resolve host {host!r} ({exc.strerror})") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                who = holder(port) or "another process"
                raise BindError(
                    f"{flag} {addr}: the address is already in use, held by {who}; stop it "
                    "or choose another port"
                ) from None
            raise BindError(f"{flag} {addr}: cannot listen there ({exc.strerror})") from None


def bind(server: Any, flag: str, addr: str, credentials: Any = None) -> int:
    """Add `addr` to a grpc server (secure when `credentials`); its port, or BindError."""
    check_free(flag, addr)
    try:
        if credentials is not None:
            port = int(server.add_secure_port(addr, credentials))
        else:
            port = int(server.add_insecure_port(addr))
    except RuntimeError:
        port = 0
    if port == 0:
        check_free(flag, addr)  # taken in between: say by whom
        raise BindError(f"{flag} {addr}: gRPC could not listen there")
    return port
