"""Who can reach a listening port, and what protects it: shared by `serve` and the relay
(whose import contract reaches only the edge's plumbing, never the service)."""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from cohortgate.coordinator.contract.addr import split_host_port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposed(addr: str) -> bool:
    """True when `addr` (HOST:PORT, or 'off') listens beyond loopback."""
    return addr != "off" and not is_loopback(split_host_port(addr)[0])


def check_tls_files(
    flags: str, cert: Path | None, key: Path | None, client_ca: Path | None
) -> None:
    """The server TLS settings go together and name files that exist. `flags` is the flags'
    common prefix as the user spells them ('--tls' for --tls-cert, --tls-key, ...)."""
    if (cert is None) != (key is None):
        raise ValueError(f"{flags}-cert and {flags}-key go together: give both or neither")
    if client_ca is not None and cert is None:
        raise ValueError(f"{flags}-client-ca (mutual TLS) needs {flags}-cert and {flags}-key")
    for suffix, path in (("cert", cert), ("key", key), ("client-ca", client_ca)):
        if path is not None and not path.is_file():
            raise ValueError(f"{flags}-{suffix} {path}: no such file")


@dataclass(frozen=True)
class ServerTLS:
    """TLS for one listening port: its certificate and key, and with `client_ca`, mutual
    TLS. Every port that listens (serve's gRPC and HTTP ports, a relay's) is served from
    one of these; `check` runs once, when its settings are read."""

    cert: Path | None = None
    key: Path | None = None
    client_ca: Path | None = None

    @property
    def on(self) -> bool:
        return self.cert is not None and self.key is not None

    @property
    def mode(self) -> str:
        return "mutual" if self.client_ca else "on" if self.on else "off"

    def check(self, flags: str = "--tls") -> None:
        check_tls_files(flags, self.cert, self.key, self.client_ca)

    def credentials(self) -> grpc.ServerCredentials | None:
        """For a gRPC port (None: clear text)."""
        if self.cert is None or self.key is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.client_ca.read_bytes() if self.client_ca else None,
            require_client_auth=self.client_ca is not None,
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """For an HTTP port (None: clear text): the same certificate as the gRPC port."""
        if self.cert is None or self.key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        return context


def unprotected(tls: bool, tokens: bool | None) -> str | None:
    """What an exposed port lacks ('TLS', 'TLS and tokens', ...), or None. `tokens` None:
    the port checks no tokens of its own (a relay passes the ranks' tokens upstream)."""
    missing = [what for what, absent in (("TLS", not tls), ("tokens", tokens is False)) if absent]
    return " and ".join(missing) or None
