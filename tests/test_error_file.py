"""torchrun's error file is written whole or not at all: torchrun SIGTERMs the other ranks as
soon as one exits, and a half-written file made torchrun itself crash (no Root Cause)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from cohortgate.agent.torchrun import write_error_file

WRITER = """
import sys
from cohortgate.agent.torchrun import write_error_file
print("ready", flush=True)
write_error_file(sys.argv[1], "ReplicasDiverged: x", "y" * 40_000_000)
"""


def test_an_error_file_is_valid_json_with_the_report(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    write_error_file(str(path), "CohortRefused: rank 2 differs", "rank 2 differs\nreport")
    data = json.loads(path.read_text())["message"]
    assert data["message"] == "CohortRefused: rank 2 differs"
    assert data["extraInfo"]["py_callstack"] == "rank 2 differs\nreport"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]  # no partial file left


def test_a_rank_killed_while_writing_leaves_no_half_written_file(tmp_path: Path) -> None:
    """SIGTERM at increasing points of a 40 MB write: the file is absent or whole."""
    for attempt in range(8):
        path = tmp_path / f"error-{attempt}.json"
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        time.sleep(0.01 * attempt)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        if path.exists():
            data = json.loads(path.read_text())  # a partial file fails here
            assert data["message"]["message"] == "ReplicasDiverged: x"
