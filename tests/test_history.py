"""The verdict history stores domain verdicts and gives back the very verdict ranks received."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from cohortgate.coordinator.decision.cohort import CohortState, Member
from cohortgate.coordinator.decision.formation import FormationOptions, decide
from cohortgate.coordinator.decision.report import build_verdict
from cohortgate.coordinator.edge.replies import verdict_to_pb
from cohortgate.coordinator.state.base import VerdictRow
from cohortgate.coordinator.state.history import History
from cohortgate.coordinator.state.records import (
    members_from_text,
    members_to_text,
    received,
    verdict_to_json,
)


def _manifest(names: range, dtype: str) -> Manifest:
    return Manifest.of(Entry(Kind.PARAMETER, f"w{i}", dtype, (4, i + 1), True) for i in names)


def _refused_with_a_long_diff() -> tuple[CohortState, Manifest, Manifest]:
    # Lists longer than the wire's LIST_CAP (20): the stored verdict keeps 20 and the counts.
    reference, other = _manifest(range(60), "float32"), _manifest(range(30, 90), "bfloat16")
    state = CohortState("long-diff", 3, 3, first_join_at=100.0)
    for rank in range(3):
        manifest = other if rank == 2 else reference
        state.add(
            Member(
                rank=rank,
                host=f"node{rank}",
                pid=rank,
                incarnation=f"i{rank}",
                signature=manifest.signature(),
                manifest_entries=len(manifest),
            ),
            100.0,
        )
        state.manifests[manifest.signature()] = manifest
    return state, reference, other


def test_a_refused_verdict_with_a_long_diff_replays_exactly(tmp_path: Path) -> None:
    state, _, _ = _refused_with_a_long_diff()
    options = FormationOptions()
    now = time.time()  # a verdict from 1970 would be pruned as past the retention
    verdict = build_verdict(state, decide(state, now, options), now, 600.0)
    assert verdict.cause is not None and verdict.diffs, "a refusal with a diff, as set up"
    history = History(tmp_path / "h.sqlite")
    history.record(
        VerdictRow(
            verdict.cohort_id,
            "long-diff",
            3,
            "refused",
            verdict.cause.value,
            verdict.reason,
            verdict.report,
            3,
            verdict.decided_at,
            {r: f"i{r}" for r in range(3)},
            verdict,
        )
    )
    history.close()
    replayed = History(tmp_path / "h.sqlite").verdict_of("long-diff", "i2")
    assert replayed is not None
    assert verdict_to_pb(replayed) == verdict_to_pb(verdict)
    (d,) = replayed.diffs.values()
    assert d is not None and len(d.missing) == 20 and d.count("missing") == 30
    assert History(tmp_path / "h.sqlite").verdict_of("long-diff", "another") is None


# What a coordinator of 0.2 wrote: members as a JSON object, no gates.
SCHEMA_0_2 = """
CREATE TABLE verdicts (
    cohort_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, round INTEGER NOT NULL,
    outcome TEXT NOT NULL, cause TEXT NOT NULL, reason TEXT NOT NULL, report TEXT NOT NULL,
    world_size INTEGER NOT NULL, decided_at REAL NOT NULL, members TEXT NOT NULL,
    verdict BLOB, record TEXT
);
CREATE INDEX verdicts_job_round ON verdicts (job_id, round);
CREATE INDEX verdicts_decided_at ON verdicts (decided_at);
"""


def test_a_file_of_an_earlier_coordinator_replays_and_lists(tmp_path: Path) -> None:
    """Before 0.3 the members were a JSON object and there were no gates: such a file is
    read as it is, read-only and read-write, and new verdicts go beside its rows."""
    state, _, _ = _refused_with_a_long_diff()
    now = time.time()
    verdict = build_verdict(state, decide(state, now, FormationOptions()), now, 600.0)
    path = tmp_path / "old.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.executescript(SCHEMA_0_2)
        db.execute(
            "INSERT INTO verdicts (cohort_id, job_id, round, outcome, cause, reason, report, "
            "world_size, decided_at, members, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                verdict.cohort_id,
                "long-diff",
                3,
                "refused",
                "signature_mismatch",
                verdict.reason,
                verdict.report,
                3,
                verdict.decided_at,
                json.dumps({"0": "i0", "1": "i1", "2": "i2"}),
                verdict_to_json(verdict),
            ),
        )
        db.commit()
    readonly = History(path, readonly=True)
    assert readonly.verdict_of("long-diff", "i1") == verdict
    readonly.close()
    history = History(path)
    assert history.verdict_of("long-diff", "i2") == verdict
    assert history.verdict_of("long-diff", "i9") is None
    row = history.get("long-diff")
    assert row is not None and row.members == {0: "i0", 1: "i1", 2: "i2"}
    assert history.last_round("long-diff") == 3
    history.close()


@given(st.dictionaries(st.integers(0, 1 << 20), st.text("0123456789abcdef:-.", min_size=1)))
def test_who_received_a_verdict_is_written_and_read_back(members: dict[int, str]) -> None:
    text = members_to_text(members)
    assert members_from_text(text) == members
    for incarnation in members.values():
        assert received(text, incarnation)
    assert not received(text, "not-an-incarnation")
    head = ranges.compress(members)
    if head not in members.values():
        assert not received(text, head), "the ranks line is not an incarnation"
