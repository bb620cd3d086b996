"""`cohortgate run`: torchrun behind a coordinator (or a relay to one), as one command."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from pydantic import ValidationError

from cohortgate.coordinator.cli.flags import flag_of, settings_errors
from cohortgate.coordinator.cli.launch import (
    JobId,
    LaunchError,
    TorchrunArgs,
    check_script,
    job_id,
    parse_torchrun,
)
from cohortgate.coordinator.cli.ops_settings import RunSettings
from cohortgate.coordinator.cli.spawn import spawn
from cohortgate.coordinator.edge.config import prune_runs, run_history
from cohortgate.coordinator.edge.settings import env_var, from_env_and_flags


def _options_text() -> str:
    """`run`'s own options, from its settings model: flag, meaning, default and variable."""
    lines = []
    for name, field in RunSettings.model_fields.items():
        flag = flag_of(name, RunSettings)
        head = flag if field.annotation is bool else f"{flag} {_METAVARS.get(name, 'VALUE')}"
        said = f"{field.description} (${env_var(RunSettings, name)})"
        lines.append(
            f"  {head}\n"
            + textwrap.fill(said, 90, initial_indent=" " * 6, subsequent_indent=" " * 6)
        )
    lines.append("  -h, --help\n      this text")
    return "\n".join(lines)


_METAVARS = {"coordinator": "HOST:PORT", "join_deadline": "SECONDS"}

RUN_USAGE = f"""\
usage: cohortgate run [cohortgate's options] [torchrun options] script.py [script args]

Run torchrun with every worker gated by cohortgate, and exit with torchrun's exit code.

cohortgate's options (before torchrun's):
{_options_text()}

The job id is torchrun's --rdzv-id (TORCHELASTIC_RUN_ID in the workers), or $COHORTGATE_JOB;
a single-node or --standalone launch without one gets a random id, printed on stdout. A
multi-node launch needs --rdzv-id, the same on every node, and --coordinator.
The coordinator started here takes its other settings from COHORTGATE_* variables (see
`cohortgate serve --help`). Everything after cohortgate's options goes to torchrun unchanged;
unknown options and a missing script are refused before anything starts.
SIGINT or SIGTERM ends torchrun, its workers and the coordinator or relay, removes the
temporary directory, and exits 128+signal (130, 143).
"""

# flag -> RunSettings field; with -h/--help, what is taken off the front of the command line
_FLAGS = {flag_of(name, RunSettings): name for name in RunSettings.model_fields}
OWN_OPTIONS = (*_FLAGS, "-h", "--help")
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


def _own_options(argv: list[str]) -> RunSettings | None:
    """`run`'s own options off the front of `argv` (None: --help), read as every command's
    settings are (its variables, then the flags given)."""
    given: dict[str, object] = {}
    while argv and argv[0].partition("=")[0] in OWN_OPTIONS:
        flag, eq, inline = argv.pop(0).partition("=")
        if flag in ("-h", "--help"):
            return None
        name = _FLAGS[flag]
        if RunSettings.model_fields[name].annotation is bool:
            given[name] = True
            continue
        if not eq and not argv:
            raise LaunchError(f"{flag} needs a value\n\n{RUN_USAGE}")
        given[name] = inline if eq else argv.pop(0)
    try:
        return from_env_and_flags(RunSettings, given)
    except ValidationError as exc:
        raise LaunchError("; ".join(settings_errors(RunSettings, given, exc))) from None


def _checked_launch(own: RunSettings, argv: list[str]) -> tuple[TorchrunArgs, JobId]:
    """torchrun's command line parsed and checked, and the job id it implies."""
    torchrun_args = parse_torchrun(argv)
    check_script(torchrun_args)
    job = job_id(torchrun_args)
    if not own.coordinator and torchrun_args.max_nodes() > 1:
        raise LaunchError(
            "a multi-node launch needs --coordinator HOST:PORT, a coordinator every node "
            "reaches (start one with `cohortgate serve --listen 0.0.0.0:7070 "
            "--allow-remote`): the one `cohortgate run` starts listens on loopback only"
        )
    return torchrun_args, job


def cmd_run(argv: Sequence[str]) -> int:
    argv = list(argv)
    try:
        own = _own_options(argv)
        if own is None:
            print(RUN_USAGE)
            return 0
        torchrun_args, job = _checked_launch(own, argv)
        if importlib.util.find_spec("torch") is None:
            raise LaunchError(
                "torch is not installed in this Python: torchrun and its workers need it. "
                "Install the agent's extra: pip install 'cohortgate[agent]'"
            )
    except (LaunchError, ValueError) as exc:
        return _fail(f"{exc}\n(see cohortgate run --help)")
    env = dict(os.environ)
    env["COHORTGATE_JOB"] = job.value
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    children: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="cohortgate-") as tmp:
        try:
            env["COHORTGATE_ADDR"] = _endpoint(own, torchrun_args, Path(tmp), env, children)
            generated = " (generated: pass --rdzv-id to choose it)" if job.generated else ""
            if not own.coordinator:
                where = f"coordinator {env['COHORTGATE_ADDR']} (started here)"
            elif not own.no_relay:
                where = f"coordinator {own.coordinator} through this node's relay "
                where += env["COHORTGATE_ADDR"]
            else:
                where = f"coordinator {own.coordinator}"
            print(f"[cohortgate] job {job.value}{generated}, {where}", flush=True)
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
            for child in reversed(children):
                _end(child)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _retention_days(env: dict[str, str]) -> float:
    """The history retention the coordinator started here applies (its variable, else its
    default), for the run histories of earlier jobs too."""
    from cohortgate.coordinator.edge.config import ServeConfig

    raw = env.get("COHORTGATE_HISTORY_RETENTION_DAYS", "")
    try:
        return float(raw) if raw else ServeConfig.model_fields["history_retention_days"].default
    except ValueError:
        return float(ServeConfig.model_fields["history_retention_days"].default)


def _endpoint(
    own: RunSettings,
    torchrun_args: TorchrunArgs,
    tmp: Path,
    env: dict[str, str],
    children: list[subprocess.Popen[bytes]],
) -> str:
    """The address the workers join: a coordinator started here (single node), a relay to
    the given coordinator (one per node), or that coordinator itself (--no-relay)."""
    if not own.coordinator:
        history = run_history(env["COHORTGATE_JOB"])
        history.parent.mkdir(parents=True, exist_ok=True)
        prune_runs(_retention_days(env), keep=history)
        flags = ["--metrics-listen", "127.0.0.1:0", "--log-format", "console"]
        flags += ["--history", str(history)]
        if own.join_deadline is not None:
            flags += ["--join-deadline", f"{own.join_deadline:g}"]
        server, port = spawn(
            tmp / "port", flags, stdout=sys.stderr, new_session=True, preexec=_die_with_parent
        )
        children.append(server)
        return f"127.0.0.1:{port}"
    if own.no_relay:
        return own.coordinator
    local = torchrun_args.value("nproc_per_node")
    relay, relay_port = spawn(
        tmp / "relay-port",
        [
            "--upstream",
            own.coordinator,
            "--log-format",
            "console",
            *(["--local-ranks", local] if local and local.isdigit() else []),
        ],
        stdout=sys.stderr,
        command="relay",
        new_session=True,
        preexec=_die_with_parent,
        # Its port is on loopback for this node's workers: in clear, whatever the shell
        # says for relays that serve a rack.
        env={k: v for k, v in os.environ.items() if not k.startswith("COHORTGATE_RELAY_TLS")},
    )
    children.append(relay)
    print(f"[cohortgate] relay 127.0.0.1:{relay_port}", file=sys.stderr, flush=True)
    # The relay speaks TLS upstream; the workers reach it on loopback in clear.
    for name in [k for k in env if k.startswith("COHORTGATE_TLS")]:
        del env[name]
    return f"127.0.0.1:{relay_port}"


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
