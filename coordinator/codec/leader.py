"""Finding the leading coordinator among replicas: COHORTGATE_ADDR may list several
(`a:7070,b:7070`); a standby answers a join with UNAVAILABLE and the leader's advertised
address in the trailing metadata LEADER_KEY, which the client follows at once. A single
address (a Kubernetes Service that routes to the ready replica) works as before."""

from __future__ import annotations

import random
from typing import Any

from cohortgate.coordinator.contract.addr import split_host_port
from cohortgate.coordinator.contract.settings import SettingError

LEADER_KEY = "cohortgate-leader"
# While no replica leads (a failover, etcd away), a client asks again within this (jittered
# down to half of it, so a job's ranks do not ask in lockstep): the first verdict after a
# takeover comes at most this long after the new leader leads.
NO_LEADER_RETRY_S = 0.5


def addresses(spec: str, what: str = "COHORTGATE_ADDR") -> list[str]:
    """`a:7070,b:7070` -> ["a:7070", "b:7070"], each checked."""
    found = [a.strip() for a in spec.split(",") if a.strip()]
    if not found:
        raise SettingError(f"{what} is empty; give HOST:PORT (or several, comma-separated)")
    for addr in found:
        try:
            split_host_port(addr)
        except ValueError as exc:
            raise SettingError(f"{what}={spec}: {exc}") from None
    return found


def leader_of(error: Any) -> str:
    """The leader a standby named in its answer ("" if none)."""
    try:
        trailing = error.trailing_metadata() or ()
    except Exception:
        return ""
    for item in trailing:
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == LEADER_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            try:
                split_host_port(text)
            except ValueError:
                return ""
            return text
    return ""


class Upstream:
    """The replicas a client may reach, and the one it tries now."""

    def __init__(self, spec: str, what: str = "COHORTGATE_ADDR") -> None:
        self.addrs = addresses(spec, what)
        self.current = self.addrs[0]
        self._tried: set[str] = set()  # since the last answer: the whole list -> back off

    @property
    def several(self) -> bool:
        return len(self.addrs) > 1

    def reached(self) -> None:
        self._tried.clear()

    def failed(self, error: Any) -> float | None:
        """After an UNAVAILABLE from `current`: move to the leader it named, or to the next
        address. Returns 0 to retry at once, a pause of at most NO_LEADER_RETRY_S while a
        standby says no replica leads, or None to back off as the caller does (every
        address failed)."""
        leader = leader_of(error)
        self._tried.add(self.current)
        if leader and leader not in self._tried:  # (two stale standbys never ping-pong)
            self.current = leader
            return 0.0
        standby = "standby" in (_details(error) or "")
        if self.several:
            at = self.addrs.index(self.current) if self.current in self.addrs else -1
            self.current = self.addrs[(at + 1) % len(self.addrs)]
            if self.current not in self._tried:
                return 0.0
        self._tried.clear()
        return random.uniform(0.5, 1.0) * NO_LEADER_RETRY_S if standby else None

    def __str__(self) -> str:
        return self.current if not self.several else f"{self.current} (of {','.join(self.addrs)})"


def _details(error: Any) -> str:
    try:
        return str(error.details() or "")
    except Exception:
        return ""
