"""`cohortgate run`: torchrun behind a coordinator (or a relay to one), as one command."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from coordinator.cli.launch import LaunchError, check_script, job_id, parse_torchrun
from coordinator.cli.spawn import spawn
from coordinator.contract.addr import split_host_port

RUN_USAGE = """\
usage: cohortgate run [--coordinator HOST:PORT] [--no-relay] [--join-deadline S]
                      [torchrun options] script.py [script args]

Run torchrun with every worker gated by cohortgate, and exit with torchrun's exit code.

cohortgate's options (before torchrun's):
  --coordinator HOST:PORT  a coordinator every node reaches (default: none; one is started on
                           this node, which only a single-node job can use)
  --no-relay               with --coordinator: workers join it directly (default: a relay is
                           started on this node and they join through it, one call per node)
  --join-deadline S        the coordinator started here waits S seconds for every rank
                           (default 600, or $COHORTGATE_JOIN_DEADLINE)
  -h, --help               this text

The job id is torchrun's --rdzv-id (TORCHELASTIC_RUN_ID in the workers), or $COHORTGATE_JOB;
a single-node or --standalone launch without one gets a random id, printed on stdout. A
multi-node launch needs --rdzv-id, the same on every node, and --coordinator.
The coordinator started here takes its other settings from COHORTGATE_* variables (see
`cohortgate serve --help`). Everything after cohortgate's options goes to torchrun unchanged;
unknown options and a missing script are refused before anything starts.
SIGINT or SIGTERM ends torchrun, its workers and the coordinator or relay, removes the
temporary directory, and exits 128+signal (130, 143).
"""

OWN_OPTIONS = ("--coordinator", "--join-deadline", "--no-relay", "-h", "--help")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# torchrun's own shutdown of its workers after SIGTERM; then the whole group is killed.
STOP_GRACE_S = 30.0


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux: children are still ended by the signal handlers below


_PRCTL = _prctl()


def _die_with_parent() -> None:
    """In a child, before exec: be sent SIGTERM if `cohortgate run` itself dies, even by
    SIGKILL, so no coordinator or worker outlives it (PR_SET_PDEATHSIG). Resolved before the
    fork; `cohortgate run` starts no threads, so preexec_fn is safe here."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


def _fail(message: str, code: int = 2) -> int:
    print(f"cohortgate run: {message}", file=sys.stderr)
    return code


class _Stop:
    """SIGINT/SIGTERM/SIGHUP: remember the first, end torchrun's process group."""

    def __init__(self) -> None:
        self.signum = 0
        self.at = 0.0
        self.pgid = 0

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        again = self.signum != 0
        if not again:
            self.signum, self.at = signum, time.monotonic()
            name = signal.Signals(signum).name
            print(f"[cohortgate] {name}: stopping torchrun and its workers", file=sys.stderr)
        if self.pgid:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGKILL if again else signal.SIGTERM)


def _end(child: subprocess.Popen[bytes] | None) -> None:
    if child is None or child.poll() is not None:
        return
    child.send_signal(signal.SIGTERM)
    try:
        child.wait(timeout=10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def cmd_run(argv: Sequence[str]) -> int:
    argv = list(argv)
    coordinator: str | None = None
    deadline: str | None = None
    relay = True
    while argv and argv[0].partition("=")[0] in OWN_OPTIONS:
        flag, eq, inline = argv.pop(0).partition("=")
        if flag in ("-h", "--help"):
            print(RUN_USAGE)
            return 0
        if flag == "--no-relay":
            relay = False
            continue
        if not eq and not argv:
            return _fail(f"{flag} needs a value\n\n{RUN_USAGE}")
        value = inline if eq else argv.pop(0)
        if flag == "--coordinator":
            coordinator = value
        else:
            deadline = value
    try:
        if coordinator is not None:
            split_host_port(coordinator)
        if deadline is not None and not _positive(deadline):
            raise LaunchError(f"--join-deadline {deadline!r} is not a positive number of seconds")
        torchrun_args = parse_torchrun(argv)
        check_script(torchrun_args)
        job = job_id(torchrun_args)
        if coordinator is None and torchrun_args.max_nodes() > 1:
            raise LaunchError(
                "a multi-node launch needs --coordinator HOST:PORT, a coordinator every node "
                "reaches (start one with `cohortgate serve --listen 0.0.0.0:7070 "
                "--allow-remote`): the one `cohortgate run` starts listens on loopback only"
            )
    except (LaunchError, ValueError) as exc:
        return _fail(f"{exc}\n(see cohortgate run --help)")

    env = dict(os.environ)
    env["COHORTGATE_JOB"] = job.value
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    server: subprocess.Popen[bytes] | None = None
    relay_proc: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="cohortgate-") as tmp:
        try:
            if coordinator is None:
                flags = ["--metrics-listen", "127.0.0.1:0", "--log-format", "console"]
                if deadline is not None:
                    flags += ["--join-deadline", deadline]
                server, port = spawn(
                    Path(tmp) / "port",
                    flags,
                    stdout=sys.stderr,
                    new_session=True,
                    preexec=_die_with_parent,
                )
                coordinator = f"127.0.0.1:{port}"
            elif relay:
                local = torchrun_args.value("nproc_per_node")
                relay_proc, relay_port = spawn(
                    Path(tmp) / "relay-port",
                    [
                        "--upstream",
                        coordinator,
                        "--log-format",
                        "console",
                        *(["--local-ranks", local] if local and local.isdigit() else []),
                    ],
                    stdout=sys.stderr,
                    command="relay",
                    new_session=True,
                    preexec=_die_with_parent,
                )
                print(f"[cohortgate] relay 127.0.0.1:{relay_port}", file=sys.stderr, flush=True)
                coordinator = f"127.0.0.1:{relay_port}"
                # The relay speaks TLS upstream; the workers reach it on loopback in clear.
                for name in [k for k in env if k.startswith("COHORTGATE_TLS")]:
                    del env[name]
            env["COHORTGATE_ADDR"] = coordinator
            generated = " (generated: pass --rdzv-id to choose it)" if job.generated else ""
            print(f"[cohortgate] job {job.value}{generated}, coordinator {coordinator}", flush=True)
            if stop.signum:
                return 128 + stop.signum
            torchrun = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *argv],
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 (no threads here)
            )
            stop.pgid = torchrun.pid
            return _wait(torchrun, stop)
        except RuntimeError as exc:
            return _fail(str(exc), 1)
        finally:
            for child in (relay_proc, server):
                _end(child)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def _wait(torchrun: subprocess.Popen[bytes], stop: _Stop) -> int:
    """torchrun's exit code, or 128+signal when we were stopped; its group never outlives it."""
    try:
        while True:
            try:
                code = torchrun.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop.signum and time.monotonic() - stop.at > STOP_GRACE_S:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(torchrun.pid, signal.SIGKILL)
    finally:
        # Workers torchrun left behind (it was killed, or it crashed) go with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(torchrun.pid, signal.SIGKILL)
    if stop.signum:
        print(
            f"[cohortgate] stopped by {signal.Signals(stop.signum).name} (torchrun exit {code})",
            file=sys.stderr,
        )
        return 128 + stop.signum
    return code
