"""The `cohortgate` command: serve the coordinator, or run torchrun behind one."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from cohortgate.coordinator.cli import ops as ops_cli
from cohortgate.coordinator.cli.flags import add_flags, given, settings_errors
from cohortgate.coordinator.cli.run import cmd_run
from cohortgate.coordinator.contract.settings import SettingError
from cohortgate.coordinator.edge.config import ServeConfig
from cohortgate.coordinator.edge.relay_config import RelayConfig
from cohortgate.coordinator.edge.settings import Settings, from_env_and_flags


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the coordinator",
        description="Run the cohortgate coordinator. Every flag can also be set as "
        "COHORTGATE_<NAME> (e.g. COHORTGATE_JOIN_DEADLINE=120); a flag wins over its variable.",
    )
    add_flags(p, ServeConfig)


def _relay_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "relay",
        help="run a node's relay: its ranks join here, the relay joins them upstream as one",
        description="Run a relay on a node. The node's ranks join it (COHORTGATE_ADDR=its "
        "address); it joins them to the coordinator as one group, so the coordinator holds "
        "one call per node instead of one per rank. Relays also take the groups of relays "
        "below them: point node relays' --upstream at a rack relay (its --local-ranks: every "
        "rank below it) and the coordinator holds one call per rack. Every flag can also be "
        "set as COHORTGATE_RELAY_<NAME>. The relay's own port serves TLS with --tls-cert/"
        "--tls-key (COHORTGATE_RELAY_TLS_*); its upstream TLS and token are a client's, "
        "COHORTGATE_TLS_* and the ranks' own tokens. On loopback unless --listen says "
        "otherwise.",
    )
    add_flags(p, RelayConfig)


def _settings(command: str, model: type[Settings], args: argparse.Namespace) -> Settings | None:
    """The command's settings (variables, then flags), or None once each problem is said
    in one line naming its flag."""
    flags = given(args, model)
    try:
        return from_env_and_flags(model, flags)
    except ValidationError as exc:
        for line in settings_errors(model, flags, exc):
            print(f"cohortgate {command}: {line}", file=sys.stderr)
    except ValueError as exc:
        print(f"cohortgate {command}: {exc}", file=sys.stderr)
    return None


def _serving(
    command: str, model: type[ServeConfig] | type[RelayConfig], args: argparse.Namespace
) -> int:
    """Read the command's settings, then serve until a signal: 0; 2 for bad settings (or
    a bad tokens file, read once before anything listens); 1 when a port cannot be had."""
    from cohortgate.coordinator.cli import logs

    config = _settings(command, model, args)
    if config is None:
        return 2
    logs.configure(config.log_format, config.log_level)
    try:
        asyncio.run(_serve(config))
    except ValueError as exc:
        print(f"cohortgate {command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"cohortgate {command}: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(config: ServeConfig | RelayConfig) -> None:
    if isinstance(config, ServeConfig):
        from cohortgate.coordinator.edge import server

        await server.serve(config)
        return
    from cohortgate.coordinator.edge.relay_server import serve_relay

    await serve_relay(
        config.upstream,
        config.listen,
        window_s=config.window,
        audit_window_s=config.audit_window,
        local_ranks=config.local_ranks,
        max_message_bytes=config.max_message_bytes,
        rank_grace_s=config.rank_grace,
        settings_every_s=config.settings_every,
        poll=config.upstream_rpc == "poll",
        tls=config.tls,
        port_file=str(config.port_file) if config.port_file else None,
    )


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
            return _serving("serve", ServeConfig, args)
        if args.command == "relay":
            return _serving("relay", RelayConfig, args)
        settings = _settings(args.command, args.model, args)
        if settings is None:
            return 2
        return int(args.func(settings))
    except SettingError as exc:  # a COHORTGATE_* variable a client reads (token, TLS files)
        print(f"cohortgate {argv[0] if argv else ''}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
