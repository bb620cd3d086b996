"""Start `cohortgate serve` as a child process on a free loopback port and wait until it serves."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any


def spawn(
    port_file: Path,
    flags: Sequence[str] = (),
    *,
    stdout: IO[Any] | int | None = None,
    timeout: float = 30.0,
    new_session: bool = False,
    command: str = "serve",
    preexec: Callable[[], None] | None = None,
    env: Mapping[str, str] | None = None,
    program: Sequence[str] | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """(the process, its gRPC port). The coordinator (or `command="relay"`, a relay; or
    `program`, any server that takes --listen and --port-file alike) writes its ports to
    `port_file` once it serves; an exit or a silence past `timeout` raises RuntimeError
    saying which."""
    proc = subprocess.Popen(
        [
            *(program or (sys.executable, "-m", "cohortgate.coordinator.cli", command)),
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            *flags,
        ],
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout not in (None, sys.stderr) else None,
        start_new_session=new_session,
        preexec_fn=preexec,  # noqa: PLW1509 (callers that pass one start no threads)
        env=env,
    )
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        if proc.poll() is not None:
            raise RuntimeError(f"cohortgate {command} exited with code {proc.returncode} at start")
        text = port_file.read_text().strip() if port_file.exists() else ""
        if text:
            return proc, int(text.split()[0])
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"cohortgate {command} did not start within {timeout:g}s")
