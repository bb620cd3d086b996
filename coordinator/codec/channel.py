"""Client side of the wire, shared by the agent and the CLI: channel, TLS and bearer token."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from cohortgate.coordinator.contract.settings import SettingError, token_text


@dataclass(frozen=True)
class ClientSecurity:
    """What a client presents and verifies, from COHORTGATE_* variables.

    COHORTGATE_TOKEN: bearer token. COHORTGATE_TLS_CA: CA file to verify the server with
    (COHORTGATE_TLS=1 uses the system's roots instead). COHORTGATE_TLS_CERT and
    COHORTGATE_TLS_KEY: a client certificate for mutual TLS. COHORTGATE_TLS_SERVER_NAME: the
    name to verify when the address is not in the server's certificate.
    """

    token: str | None = None
    tls: bool = False
    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, token: str | None = None
    ) -> ClientSecurity:
        env = os.environ if env is None else env

        def path(name: str) -> Path | None:
            value = env.get(name)
            return Path(value) if value else None

        ca, cert, key = (
            path("COHORTGATE_TLS_CA"),
            path("COHORTGATE_TLS_CERT"),
            path("COHORTGATE_TLS_KEY"),
        )
        for name, file in (
            ("COHORTGATE_TLS_CA", ca),
            ("COHORTGATE_TLS_CERT", cert),
            ("COHORTGATE_TLS_KEY", key),
        ):
            if file is not None and not file.is_file():
                raise SettingError(
                    f"{name}={file}: no such file; give a PEM file readable here "
                    "(or unset the variable)"
                )
        tls = bool(ca or cert) or env.get("COHORTGATE_TLS", "").lower() in ("1", "true", "yes")
        return cls(
            token=token_text("--token" if token else "COHORTGATE_TOKEN", token)
            or token_text("COHORTGATE_TOKEN", env.get("COHORTGATE_TOKEN")),
            tls=tls,
            ca=ca,
            cert=cert,
            key=key,
            server_name=env.get("COHORTGATE_TLS_SERVER_NAME") or None,
        )

    @property
    def metadata(self) -> Sequence[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def channel(self, addr: str, options: Sequence[tuple[str, int | str]] = ()) -> grpc.Channel:
        credentials, opts = self._credentials(options)
        if credentials is None:
            return grpc.insecure_channel(addr, options=opts)
        return grpc.secure_channel(addr, credentials, options=opts)

    def aio_channel(
        self, addr: str, options: Sequence[tuple[str, int | str]] = ()
    ) -> grpc.aio.Channel:
        """The same, for asyncio (the relay)."""
        credentials, opts = self._credentials(options)
        if credentials is None:
            return grpc.aio.insecure_channel(addr, options=opts)
        return grpc.aio.secure_channel(addr, credentials, options=opts)

    def _credentials(
        self, options: Sequence[tuple[str, int | str]]
    ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, int | str]]]:
        opts = list(options)
        if not self.tls:
            return None, opts
        if (self.cert is None) != (self.key is None):
            raise SettingError(
                "COHORTGATE_TLS_CERT and COHORTGATE_TLS_KEY go together: give both or neither"
            )
        credentials = grpc.ssl_channel_credentials(
            root_certificates=_pem("COHORTGATE_TLS_CA", self.ca),
            private_key=_pem("COHORTGATE_TLS_KEY", self.key),
            certificate_chain=_pem("COHORTGATE_TLS_CERT", self.cert),
        )
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return credentials, opts


def _pem(name: str, path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SettingError(f"{name}={path}: {exc.strerror or exc}") from None
