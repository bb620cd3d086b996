"""HOST:PORT addresses: the one parser the coordinator, the CLI and the agent share (light)."""

from __future__ import annotations

DEFAULT_PORT = 7070
DEFAULT_ADDR = f"127.0.0.1:{DEFAULT_PORT}"


def split_host_port(addr: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError says what is wrong."""
    host, sep, port = addr.rpartition(":")
    if (
        not sep
        or not host
        or not port.isdigit()
        or "/" in addr
        or (host.count(":") and not (host.startswith("[") and host.endswith("]")))
    ):
        raise ValueError(
            f"{addr!r} is not HOST:PORT (for example 127.0.0.1:{DEFAULT_PORT} or "
            f"[::1]:{DEFAULT_PORT}; no scheme, no path)"
        )
    if int(port) > 65535:
        raise ValueError(f"{addr!r}: port {port} is out of range (0-65535)")
    return host.strip("[]"), int(port)
