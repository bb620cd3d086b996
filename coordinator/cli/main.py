"""The `cohortgate` command: serve the coordinator, or run torchrun behind one."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from coordinator.cli import ops as ops_cli
from coordinator.cli.run import cmd_run
from coordinator.contract.addr import DEFAULT_ADDR, split_host_port
from coordinator.contract.limits import Limits
from coordinator.contract.settings import SettingError, env_seconds
from coordinator.decision.checks import policy_help
from coordinator.edge.auth import TokenStore
from coordinator.edge.config import ServeConfig, from_env_and_flags
from coordinator.edge.exposure import check_tls_files

if TYPE_CHECKING:
    from coordinator.edge.relay import RelayTLS


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
    p.add_argument("--join-deadline", type=float, help="seconds from a cohort's first join")
    p.add_argument("--manifest-timeout", type=float, help="seconds to wait for manifests")
    p.add_argument("--progress-interval", type=float, help="seconds between progress events")
    p.add_argument(
        "--watch-interval",
        type=float,
        help="seconds: a status watcher gets at most one update per job this often",
    )
    p.add_argument("--grace", type=float, help="seconds of graceful shutdown on SIGTERM")
    p.add_argument(
        "--log-format",
        choices=["auto", "json", "console"],
        help="auto: console on a tty, else JSON",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="")
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
    p.add_argument("--history-retention-days", type=float, help="days a verdict is kept")
    p.add_argument("--job-retention", type=float, help="seconds a decided job stays in memory")
    p.add_argument("--rank-grace", type=float, help="seconds within which a dead rank is dropped")
    p.add_argument(
        "--policy",
        action="append",
        help="repeatable; " + policy_help(),
    )
    p.add_argument(
        "--job-policy", action="append", help="JOB:CHECK=LEVEL, repeatable: one job's override"
    )
    p.add_argument("--tokens-file", type=Path, help="per-job bearer tokens: 'TOKEN JOB' lines")
    p.add_argument("--tls-cert", type=Path, help="server certificate (PEM)")
    p.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    p.add_argument("--tls-client-ca", type=Path, help="require client certificates from this CA")
    limits = (
        "message-bytes",
        "upload-bytes",
        "world-size",
        "manifest-entries",
        "cohorts",
        "waiting-ranks",
    )
    for limit in (
        *limits,
        "cohort-manifest-bytes",
        "manifest-bytes",
        "watchers",
        "watchers-per-token",
    ):
        p.add_argument(f"--max-{limit}", type=int, help=f"limit: max {limit.replace('-', ' ')}")
    # Every line says its default, taken from the one place defaults live.
    for action in p._actions:
        field = ServeConfig.model_fields.get(action.dest)
        if field is None or "default" in (action.help or ""):
            continue
        default = field.default
        shown = "off" if default in (None, "", False) else default
        action.help = f"{action.help or ''} (default: {shown})".lstrip()


def _relay_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "relay",
        help="run a node's relay: its ranks join here, the relay joins them upstream as one",
        description="Run a relay on a node. The node's ranks join it (COHORTGATE_ADDR=its "
        "address); it joins them to the coordinator as one group, so the coordinator holds "
        "one call per node instead of one per rank. Relays also take the groups of relays "
        "below them: point node relays' --upstream at a rack relay (its --local-ranks: every "
        "rank below it) and the coordinator holds one call per rack. Upstream TLS and token "
        "come from COHORTGATE_TLS_* / the ranks' own tokens; the relay's own port serves "
        "TLS with --tls-cert/--tls-key (COHORTGATE_RELAY_TLS_*), on loopback unless --listen "
        "says otherwise.",
    )
    p.add_argument(
        "--upstream",
        required=True,
        help="the coordinator (or a rack relay), HOST:PORT (required)",
    )
    p.add_argument(
        "--listen", default="127.0.0.1:29471", help="HOST:PORT (default 127.0.0.1:29471)"
    )
    p.add_argument(
        "--local-ranks",
        type=int,
        default=int(os.environ.get("LOCAL_WORLD_SIZE", "8")),
        help="send the group upstream once this many ranks joined, directly or through relays "
        "below (default $LOCAL_WORLD_SIZE or 8)",
    )
    p.add_argument(
        "--window",
        type=float,
        default=2.0,
        help="or this many seconds after the first rank joined (default 2; a late local rank "
        "is sent on its own at once)",
    )
    for name, what in (
        ("cert", "the relay's server certificate (PEM) for TLS on its own port"),
        ("key", "its private key (PEM)"),
        ("client-ca", "require client certificates from this CA (PEM): mutual TLS"),
    ):
        var = "COHORTGATE_RELAY_TLS_" + name.upper().replace("-", "_")
        p.add_argument(
            f"--tls-{name}",
            type=Path,
            default=None,
            help=f"{what} (default ${var} or off; the upstream's TLS is COHORTGATE_TLS_*)",
        )
    p.add_argument(
        "--rank-grace",
        type=float,
        default=None,
        help="seconds within which a dead or frozen rank's join is dropped (its group "
        "re-joins without it), and within which a coordinator that stops answering is "
        "noticed (at least 5 s) and re-joined (default $COHORTGATE_RELAY_RANK_GRACE or 15, "
        "as serve's)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=int,
        default=Limits.max_message_bytes,
        help="the largest join taken, and the most one upstream group may carry: the "
        f"coordinator's own --max-message-bytes (default {Limits.max_message_bytes})",
    )
    p.add_argument(
        "--port-file", type=Path, help="once serving, write the port here (default: none)"
    )
    p.add_argument(
        "--log-format",
        choices=["auto", "json", "console"],
        default="auto",
        help="auto: console on a tty, else JSON (default: auto)",
    )
    p.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        default="info",
        help="(default: info)",
    )


def _relay_tls(args: argparse.Namespace) -> RelayTLS:
    """The relay's own TLS: each flag, else its COHORTGATE_RELAY_TLS_* variable."""
    from coordinator.edge.relay import RelayTLS

    paths = {}
    for name in ("cert", "key", "client_ca"):
        given = getattr(args, f"tls_{name}")
        env = os.environ.get(f"COHORTGATE_RELAY_TLS_{name.upper()}", "").strip()
        paths[name] = given if given is not None else Path(env) if env else None
    check_tls_files("--tls", paths["cert"], paths["key"], paths["client_ca"])
    return RelayTLS(paths["cert"], paths["key"], paths["client_ca"])


def cmd_relay(args: argparse.Namespace) -> int:
    from coordinator.cli import logs
    from coordinator.edge.relay import serve_relay

    try:
        if args.rank_grace is None:
            args.rank_grace = env_seconds("COHORTGATE_RELAY_RANK_GRACE", 15.0)
        tls = _relay_tls(args)
    except (SettingError, ValueError) as exc:
        print(f"cohortgate relay: {exc}", file=sys.stderr)
        return 2
    if (
        args.local_ranks < 1
        or args.window < 0
        or args.max_message_bytes < 512 * 1024
        or not args.rank_grace > 0
    ):
        print(
            "cohortgate relay: --local-ranks must be >= 1, --window >= 0, --rank-grace > 0 "
            "and --max-message-bytes >= 524288",
            file=sys.stderr,
        )
        return 2
    try:
        split_host_port(args.upstream)
        split_host_port(args.listen)
    except ValueError as exc:
        print(f"cohortgate relay: {exc}", file=sys.stderr)
        return 2
    logs.configure(args.log_format, args.log_level)
    try:
        asyncio.run(
            serve_relay(
                args.upstream,
                args.listen,
                window_s=args.window,
                local_ranks=args.local_ranks,
                max_message_bytes=args.max_message_bytes,
                rank_grace_s=args.rank_grace,
                tls=tls,
                port_file=str(args.port_file) if args.port_file else None,
            )
        )
    except OSError as exc:
        print(f"cohortgate relay: {exc}", file=sys.stderr)
        return 1
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from coordinator.cli import logs
    from coordinator.edge import server

    flags = {k: v for k, v in vars(args).items() if k not in ("command", "func")}
    for name in ("policy", "job_policy"):
        if flags.get(name):
            flags[name] = ",".join(flags[name])
    try:
        config = from_env_and_flags(ServeConfig, flags)
        config.check_exposure()
        config.check_tls()
        config.policies  # noqa: B018 (parsed now so a typo stops the start)
        if config.tokens_file is not None:
            TokenStore.load(config.tokens_file)  # read now: a bad file is one line, no start
    except ValidationError as exc:
        for error in exc.errors():
            where = "--" + "-".join(str(x) for x in error["loc"]).replace("_", "-")
            message = str(error["msg"]).removeprefix("Value error, ")
            print(f"cohortgate serve: {where}: {message}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"cohortgate serve: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_format, config.log_level)
    try:
        asyncio.run(server.serve(config))
    except OSError as exc:
        print(f"cohortgate serve: {exc}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cohortgate",
        description="Refuse to form a distributed PyTorch cohort until every rank has joined "
        "with a matching model signature.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _serve_parser(sub)
    _relay_parser(sub)
    ops_cli.add_parsers(sub)
    sub.add_parser(
        "run",
        help="run torchrun behind a coordinator (see `cohortgate run --help`)",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "run":
            return cmd_run(argv[1:])
        args = build_parser().parse_args(argv)
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "relay":
            return cmd_relay(args)
        return int(args.func(args))
    except SettingError as exc:  # a COHORTGATE_* variable a client reads (token, TLS files)
        print(f"cohortgate {argv[0] if argv else ''}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
