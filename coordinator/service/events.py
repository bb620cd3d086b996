"""What a waiting rank's call receives, in domain terms: progress, upload asks, the verdict."""

from __future__ import annotations

from dataclasses import dataclass

from cohortgate.coordinator.decision.cohort import UploadKind
from cohortgate.coordinator.decision.verdict import Verdict
from cohortgate.coordinator.state.asks import UploadRef


@dataclass(frozen=True)
class Progress:
    job_id: str
    round: int
    joined: int
    expected: int
    missing_ranks: str
    message: str
    deadline_in_s: float


@dataclass(frozen=True)
class UploadAsk:
    """Tell the rank of `ref` to upload `kind` (its manifest, its per-tensor digests)."""

    kind: UploadKind
    key: bytes  # the signature or weights digest the upload is for
    ref: UploadRef


JoinEvent = Progress | UploadAsk | Verdict
