"""The `cohortgate` command: serve the coordinator, or run torchrun behind one."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from coordinator import ops_cli
from coordinator.config import DEFAULT_ADDR, ServeConfig, from_env_and_flags
from coordinator.spawn import spawn


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the coordinator",
        description="Run the cohortgate coordinator. Every flag can also be set as "
        "COHORTGATE_<NAME> (e.g. COHORTGATE_JOIN_DEADLINE=120); a flag wins over its variable.",
    )
    p.add_argument(
        "--listen", help=f"gRPC address HOST:PORT (default {DEFAULT_ADDR}; port 0 picks one)"
    )
    p.add_argument(
        "--allow-remote",
        action="store_const",
        const=True,
        help="allow a non-loopback --listen address",
    )
    p.add_argument("--join-deadline", type=float, help="seconds from a cohort's first join (600)")
    p.add_argument("--manifest-timeout", type=float, help="seconds to wait for manifests (30)")
    p.add_argument("--progress-interval", type=float, help="seconds between progress events (1)")
    p.add_argument("--grace", type=float, help="seconds of graceful shutdown on SIGTERM (5)")
    p.add_argument(
        "--log-format", choices=["auto", "json", "console"], help="(auto: console on a tty)"
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--port-file",
        type=Path,
        help="once serving, write the gRPC port, then the metrics port, one per line",
    )
    p.add_argument(
        "--metrics-listen",
        help="HTTP HOST:PORT for /metrics, /status, /status.json (default 127.0.0.1:9470; off)",
    )
    p.add_argument(
        "--history",
        help="SQLite file of past verdicts (default ~/.local/state/cohortgate/history.sqlite; off)",
    )
    p.add_argument("--history-retention-days", type=float, help="days a verdict is kept (30)")
    p.add_argument("--job-retention", type=float, help="seconds a decided job stays in memory")
    p.add_argument(
        "--rank-grace", type=float, help="seconds within which a dead rank is dropped (15)"
    )
    p.add_argument(
        "--policy",
        action="append",
        help="CHECK=LEVEL, repeatable: model, layout, coverage, runtime.device_type, "
        "runtime.nccl, runtime.torch, runtime.cuda, runtime.device_name, "
        "runtime.device_capability; strict (refuse), warn (form and record), off",
    )
    p.add_argument(
        "--job-policy", action="append", help="JOB:CHECK=LEVEL, repeatable: one job's override"
    )
    p.add_argument("--tokens-file", type=Path, help="per-job bearer tokens: 'TOKEN JOB' lines")
    p.add_argument("--tls-cert", type=Path, help="server certificate (PEM)")
    p.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    p.add_argument("--tls-client-ca", type=Path, help="require client certificates from this CA")
    for limit in ("message-bytes", "world-size", "manifest-entries", "cohorts", "waiting-ranks"):
        p.add_argument(f"--max-{limit}", type=int, help=f"limit: max {limit.replace('-', ' ')}")


def cmd_serve(args: argparse.Namespace) -> int:
    from coordinator import logs, server

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
    for name in ("policy", "job_policy"):
        if flags.get(name):
            flags[name] = ",".join(flags[name])
    try:
        config = from_env_and_flags(ServeConfig, flags)
        config.check_exposure()
        config.check_tls()
        config.policies  # noqa: B018 (parsed now so a typo stops the start)
    except (ValidationError, ValueError) as exc:
        print(f"cohortgate serve: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_format, config.log_level)
    try:
        asyncio.run(server.serve(config))
    except OSError as exc:
        print(f"cohortgate serve: {exc}", file=sys.stderr)
        return 1
    return 0


RUN_USAGE = """\
usage: cohortgate run [--coordinator HOST:PORT] [--join-deadline S]
                      [torchrun options] script.py [args]

Start a coordinator beside torchrun on this node (or use --coordinator), set COHORTGATE_ADDR
and COHORTGATE_JOB for the workers, run torchrun, and exit with its exit code.
Everything after cohortgate's own options goes to torchrun unchanged.
"""


def cmd_run(argv: Sequence[str]) -> int:
    argv = list(argv)
    coordinator: str | None = None
    deadline: str | None = None
    while argv and argv[0] in ("--coordinator", "--join-deadline", "-h", "--help"):
        flag = argv.pop(0)
        if flag in ("-h", "--help"):
            print(RUN_USAGE)
            return 0
        if not argv:
            print(f"cohortgate run: {flag} needs a value\n\n{RUN_USAGE}", file=sys.stderr)
            return 2
        if flag == "--coordinator":
            coordinator = argv.pop(0)
        else:
            deadline = argv.pop(0)
    if not argv:
        print(f"cohortgate run: no training script given\n\n{RUN_USAGE}", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env.setdefault("COHORTGATE_JOB", f"run-{uuid.uuid4().hex[:12]}")
    server: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="cohortgate-") as tmp:
        try:
            if coordinator is None:
                flags = ["--metrics-listen", "127.0.0.1:0", "--log-format", "console"]
                if deadline is not None:
                    flags += ["--join-deadline", deadline]
                server, port = spawn(Path(tmp) / "port", flags, stdout=sys.stderr)
                coordinator = f"127.0.0.1:{port}"
            env["COHORTGATE_ADDR"] = coordinator
            print(
                f"[cohortgate] coordinator {coordinator}, job {env['COHORTGATE_JOB']}",
                file=sys.stderr,
                flush=True,
            )
            torchrun = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", *argv], env=env
            )
            try:
                return torchrun.wait()
            except KeyboardInterrupt:
                torchrun.send_signal(signal.SIGINT)
                return torchrun.wait()
        except RuntimeError as exc:
            print(f"cohortgate run: {exc}", file=sys.stderr)
            return 1
        finally:
            if server is not None and server.poll() is None:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cohortgate",
        description="Refuse to form a distributed PyTorch cohort until every rank has joined "
        "with a matching model signature.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)
    ops_cli.add_parsers(sub)
    sub.add_parser(
        "run",
        help="run torchrun behind a coordinator (see `cohortgate run --help`)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        return cmd_run(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
