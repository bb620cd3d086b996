"""Domain errors, one type per kind of failure; the servicer maps each to one gRPC status."""

from __future__ import annotations


class CoordinatorError(Exception):
    """Base: the message says what was wrong and what to do."""


class InvalidArgument(CoordinatorError):
    """The request itself is malformed or out of range."""


class FailedPrecondition(CoordinatorError):
    """The request is well-formed but does not fit the coordinator's state."""


class AlreadyHeld(CoordinatorError):
    """The rank is already held by another live incarnation."""


class NotFound(CoordinatorError):
    """The job, round or rank named does not exist."""


class LimitExceeded(CoordinatorError):
    """A configured limit would be passed."""


class Unauthenticated(CoordinatorError):
    """No valid credentials for the job named."""


class Unavailable(CoordinatorError):
    """The coordinator cannot serve now (shutting down); the caller should retry."""


class NotLeader(Unavailable):
    """This replica stands by: `leader` is the advertised address of the one that leads
    ("" while none does), which the agent follows at once."""

    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


class PermissionDenied(CoordinatorError):
    """A valid token for another job."""
