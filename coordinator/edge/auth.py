"""Per-job bearer tokens: a token opens one job (or, as admin, every job); constant-time checks."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cohortgate.coordinator.contract.errors import PermissionDenied, Unauthenticated

ADMIN = "*"


@dataclass(frozen=True)
class Grant:
    """Who a valid token speaks for: one job id, or ADMIN."""

    scope: str

    @property
    def admin(self) -> bool:
        return self.scope == ADMIN

    def allows(self, job_id: str) -> bool:
        return self.admin or hmac.compare_digest(self.scope.encode(), job_id.encode())


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class TokenStore:
    """Tokens from a file: one `TOKEN JOB_ID` per line (`*` for an admin token), # comments.

    Tokens are held only as SHA-256 digests; a presented token is hashed and the digests
    compared with hmac.compare_digest, so neither the lookup nor the comparison leaks how
    much of a guess was right.
    """

    def __init__(self, grants: dict[bytes, Grant]) -> None:
        self._grants = grants

    @classmethod
    def load(cls, path: Path) -> TokenStore:
        grants: dict[bytes, Grant] = {}
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(
                f"--tokens-file {path}: not UTF-8 text (byte {exc.start}); expected "
                "'TOKEN JOB_ID' lines"
            ) from None
        except OSError as exc:
            raise ValueError(f"--tokens-file {path}: {exc.strerror or exc}") from None
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(
                    f"--tokens-file {path}:{number}: expected 'TOKEN JOB_ID' (or 'TOKEN *' "
                    "for an admin token)"
                )
            token, scope = parts
            if len(token) < 16:
                raise ValueError(
                    f"--tokens-file {path}:{number}: a token must be at least 16 characters"
                )
            grants[_digest(token)] = Grant(scope)
        if not grants:
            raise ValueError(f"--tokens-file {path} holds no tokens")
        return cls(grants)

    @staticmethod
    def exposure(path: Path) -> str | None:
        """A warning when others than the owner may read the tokens file, else None."""
        mode = path.stat().st_mode & 0o777
        if not mode & 0o077:
            return None
        return (
            f"--tokens-file {path} has mode {mode:o}: others on this machine can read every "
            f"token; run chmod 600 {path}"
        )

    def grant(self, metadata: Sequence[tuple[str, str | bytes]]) -> Grant:
        """The grant of the call's `authorization: Bearer TOKEN`, or Unauthenticated."""
        header = next((v for k, v in metadata if k == "authorization"), None)
        if header is None:
            raise Unauthenticated(
                "no token: send 'authorization: Bearer TOKEN' (agents: set COHORTGATE_TOKEN)"
            )
        text = header.decode() if isinstance(header, bytes) else header
        scheme, _, token = text.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("the authorization header must be 'Bearer TOKEN'")
        presented = _digest(token.strip())
        for digest, grant in self._grants.items():
            if hmac.compare_digest(digest, presented):
                return grant
        raise Unauthenticated("the token is not valid on this coordinator")


class Auth:
    """The coordinator's policy: open (no token file) or token-checked."""

    def __init__(self, store: TokenStore | None) -> None:
        self.store = store

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def grant(self, metadata: Sequence[tuple[str, str | bytes]]) -> Grant:
        if self.store is None:
            return Grant(ADMIN)
        return self.store.grant(metadata)

    def check_job(self, metadata: Sequence[tuple[str, str | bytes]], job_id: str) -> Grant:
        grant = self.grant(metadata)
        if not grant.allows(job_id):
            raise PermissionDenied(
                f"this token is for another job; it cannot reach job '{job_id[:64]}'"
            )
        return grant
