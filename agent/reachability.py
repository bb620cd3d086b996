"""What a rank says while the coordinator cannot be reached: early, then now and then, in
words (not grpc's), naming a standby when no replica leads."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from cohortgate.agent.torchrun import RankIdentity, say

if TYPE_CHECKING:
    from cohortgate.agent.client import JoinOptions
    from cohortgate.coordinator.codec.leader import Upstream

logger = logging.getLogger("cohortgate.agent")


def say_progress(message: str) -> None:
    """Progress goes to our logger; where the host program configured none, to stderr."""
    if logger.hasHandlers():
        logger.info(message)
    else:
        say(f"[cohortgate] {message}")


def _transport(details: str) -> str:
    """grpc's long UNAVAILABLE text -> what went wrong, in words."""
    if "standby" in details:  # a replica's own words (which may quote etcd's error)
        return details
    for needle, words in (
        ("Connection refused", "connection refused (nothing listens there)"),
        ("Domain name not found", "host name not found"),
        ("lookup", "host name not found"),
        ("Connection reset", "connection reset"),
        ("timed out", "connection timed out"),
        ("Timeout", "connection timed out"),
        ("No route to host", "no route to host"),
        ("shutting down", "the coordinator is shutting down"),
    ):
        if needle in details:
            return words
    return details


class Reachability:
    """Says on stderr, early and then now and then, that the coordinator cannot be reached:
    silence until COHORTGATE_TIMEOUT (15 minutes) looks exactly like a hang."""

    def __init__(self, identity: RankIdentity, give_up_at: float, opts: JoinOptions) -> None:
        self.identity = identity
        self.give_up_at = give_up_at
        self.opts = opts
        self.failing_since: float | None = None
        self.last = ""
        # A replica's own words that it stands by, seen since the coordinator was last
        # reached: while one answers, no replica leads (whatever the others' errors say).
        self.standby = ""
        self.said_at: float | None = None
        self.upstream: Upstream | None = None

    def failed(self, details: str) -> None:
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        self.last = _transport(details)
        if "standby" in self.last:
            self.standby = self.last
        if now - self.failing_since < self.opts.unreachable_after_s:
            return
        if self.said_at is not None and now - self.said_at < self.opts.unreachable_every_s:
            return
        self.said_at = now
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + self.give_up_at - now))
        message = (
            f"cannot reach the cohortgate coordinator at {self.identity.addr}: {self.last}; "
            f"retrying until {until} (COHORTGATE_TIMEOUT={self.opts.timeout_s:g}s)"
        )
        if self.standby:
            also = f" (and: {self.last})" if self.last != self.standby else ""
            message = (
                f"no cohortgate coordinator at {self.identity.addr} leads now: "
                f"{self.standby}{also}; asking again every half second until {until} "
                f"(COHORTGATE_TIMEOUT={self.opts.timeout_s:g}s)"
            )
        if self.identity.rank == 0:
            say_progress(message)
        else:
            logger.debug("rank %d: %s", self.identity.rank, message)

    def reached(self) -> None:
        if self.upstream is not None:
            self.upstream.reached()
        if self.said_at is not None and self.identity.rank == 0:
            at = self.upstream.current if self.upstream is not None else self.identity.addr
            say_progress(f"reached the cohortgate coordinator at {at}")
        self.failing_since = self.said_at = None
        self.standby = ""
