"""Who sends an upload (its reference, the key of every waiting call)."""

from __future__ import annotations

from typing import NamedTuple


class UploadRef(NamedTuple):
    """Who sends an upload: one incarnation of one rank in one round of a job. A tuple: it
    keys every waiting call, and a tuple hashes in C."""

    job_id: str
    round: int
    rank: int
    incarnation: str
