"""Domain errors, one type per kind of failure; the servicer maps each to one gRPC status."""

from __future__ import annotations


class CohortgateError(Exception):
    """Base: the message says what was wrong and what to do."""


class InvalidArgument(CohortgateError):
    """The request itself is malformed or out of range."""


class FailedPrecondition(CohortgateError):
    """The request is well-formed but does not fit the coordinator's state."""


class AlreadyHeld(CohortgateError):
    """The rank is already held by another live incarnation."""


class NotFound(CohortgateError):
    """The job, round or rank named does not exist."""


class LimitExceeded(CohortgateError):
    """A configured limit would be passed."""


class Unauthenticated(CohortgateError):
    """No valid credentials for the job named."""


class Unavailable(CohortgateError):
    """The coordinator cannot serve now (shutting down); the caller should retry."""


class PermissionDenied(CohortgateError):
    """A valid token for another job."""
