"""A verdict as the etcd history stores it: the listing's fields, the verdict's JSON and
who received it, zlib-packed under a magic (state/etcd_history.py writes and reads them)."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass

from cohortgate.coordinator.state.base import VerdictRow
from cohortgate.coordinator.state.records import members_to_text, verdict_to_json

MAGIC = b"cg1"
LISTED = ("cohort_id", "job_id", "round", "outcome", "cause", "reason", "report")


def listing(row: VerdictRow) -> dict[str, object]:
    """The fields a listing reads (no members, no verdict)."""
    head: dict[str, object] = {k: getattr(row, k) for k in LISTED}
    return head | {"world_size": row.world_size, "decided_at": row.decided_at}


def pack(row: VerdictRow) -> bytes:
    body = {
        "row": listing(row),
        "record": None if row.verdict is None else verdict_to_json(row.verdict),
        "members": members_to_text(row.members),
    }
    # level 1: within 2% of level 3 on the incarnations (random hex), in 60% of the time
    return MAGIC + zlib.compress(json.dumps(body).encode(), 1)


@dataclass
class Entry:
    row: VerdictRow  # the listing (no members, no verdict)
    parts: int
    packed: bytes | None  # the record, when held in memory

    def unpacked(self) -> tuple[str | None, str]:
        """(the verdict's JSON, the members' text)."""
        assert self.packed is not None
        body = json.loads(zlib.decompress(self.packed[len(MAGIC) :]))
        return body["record"], str(body["members"])


def row_of(packed: bytes) -> VerdictRow:
    body = json.loads(zlib.decompress(packed[len(MAGIC) :]))
    return VerdictRow(**body["row"])
