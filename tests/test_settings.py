"""Bad settings fail in one line naming the setting and what it accepts: in the agent (as a
CohortgateError, written to torchrun's error file), in the CLI (exit 2), in `serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cohortgate.coordinator.codec.channel import ClientSecurity
from cohortgate.coordinator.contract.settings import SettingError, env_seconds, token_text
from tests.helpers import REPO, InProcessCoordinator, free_port

CLI = [sys.executable, "-m", "cohortgate.coordinator.cli"]
TOKEN = "a-token-of-sixteen-chars-or-more"

# A rank as torchrun starts it, joining a coordinator nobody serves (never reached: the
# setting fails first).
RANK_ENV = {
    "RANK": "0",
    "WORLD_SIZE": "1",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "1",
    "TORCHELASTIC_RUN_ID": "settings",
}
JOIN = (
    "import sys, torch, cohortgate\n"
    "try:\n"
    "    cohortgate.join(torch.nn.Linear(2, 2))\n"
    "except cohortgate.CohortgateError as exc:\n"
    "    print('ERROR', exc)\n"
    "    sys.exit(4)\n"
)


def _rank(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    error_file = tmp_path / "error.json"
    run = subprocess.run(
        [sys.executable, "-c", JOIN],
        env={
            **os.environ,
            **RANK_ENV,
            "COHORTGATE_ADDR": f"127.0.0.1:{free_port()}",
            "TORCHELASTIC_ERROR_FILE": str(error_file),
            "PYTHONPATH": str(REPO),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    message = json.loads(error_file.read_text())["message"] if error_file.exists() else {}
    return run, message


def test_the_agent_imports_whatever_cohortgate_timeout_holds() -> None:
    run = subprocess.run(
        [sys.executable, "-c", "import cohortgate.agent.client, cohortgate.agent.cohort"],
        env={**os.environ, "COHORTGATE_TIMEOUT": "abc", "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"COHORTGATE_TIMEOUT": "abc"}, "COHORTGATE_TIMEOUT='abc' is not a number"),
        ({"COHORTGATE_TIMEOUT": "-5"}, "COHORTGATE_TIMEOUT=-5 must be a finite number"),
        ({"COHORTGATE_TIMEOUT": "nan"}, "COHORTGATE_TIMEOUT=nan must be a finite number"),
        ({"COHORTGATE_TLS_CA": "/missing/ca.pem"}, "COHORTGATE_TLS_CA=/missing/ca.pem: no such"),
        ({"COHORTGATE_TOKEN": "two\nlines-of-token"}, "COHORTGATE_TOKEN holds a character"),
    ],
)
@pytest.mark.slow
def test_a_bad_agent_setting_is_one_line_naming_it_in_the_error_file(
    tmp_path: Path, env: dict[str, str], named: str
) -> None:
    run, message = _rank(tmp_path, **env)
    assert run.returncode == 4, run.stdout + run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    (line,) = run.stdout.splitlines()
    assert named in line
    assert named in message["message"]
    assert "coordinator" not in line.split(":")[0], "not blamed on the coordinator"


def test_a_token_read_from_a_file_keeps_working_with_its_newline() -> None:
    security = ClientSecurity.from_env({"COHORTGATE_TOKEN": f"  {TOKEN}\n"})
    assert security.token == TOKEN
    assert token_text("COHORTGATE_TOKEN", " \n") is None
    with pytest.raises(SettingError, match=r"COHORTGATE_TOKEN holds .*'\\t' at position 3"):
        token_text("COHORTGATE_TOKEN", "abc\tdef")


def test_a_token_with_a_trailing_newline_reaches_a_token_checked_coordinator(
    tmp_path: Path,
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} *\n")
    tokens.chmod(0o600)
    c = InProcessCoordinator(tokens_file=tokens)
    try:
        run = subprocess.run(
            [*CLI, "status", "--addr", c.addr, "--json"],
            env={**os.environ, "COHORTGATE_TOKEN": TOKEN + "\n"},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        c.stop()
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []


def test_the_cli_names_a_missing_ca_in_one_line() -> None:
    run = subprocess.run(
        [*CLI, "status", "--addr", f"127.0.0.1:{free_port()}"],
        env={**os.environ, "COHORTGATE_TLS_CA": "/missing/ca.pem"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "cohortgate status: COHORTGATE_TLS_CA=/missing/ca.pem: no such file; give a PEM file "
        "readable here (or unset the variable)"
    )


def test_env_seconds_accepts_numbers_above_the_minimum_only() -> None:
    assert env_seconds("X", 9.0, {}) == 9.0
    assert env_seconds("X", 9.0, {"X": " 2.5 "}) == 2.5
    for bad in ("0", "-1", "inf", "1e999", "ten"):
        with pytest.raises(SettingError, match=r"^X="):
            env_seconds("X", 9.0, {"X": bad})


def _serve(tmp_path: Path, tokens: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *CLI,
            "serve",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--metrics-listen",
            "off",
            "--history",
            "off",
            "--tokens-file",
            str(tokens),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b"\xff\xfe tok *\n", "not UTF-8 text (byte 0)"),
        (b"short *\n", ":1: a token must be at least 16 characters"),
        (b"# nothing\n", "holds no tokens"),
        (f"{TOKEN}\n".encode(), ":1: expected 'TOKEN JOB_ID'"),
    ],
)
def test_serve_refuses_a_bad_tokens_file_in_one_line(
    tmp_path: Path, content: bytes, said: str
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_bytes(content)
    tokens.chmod(0o600)
    run = _serve(tmp_path, tokens)
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    (line,) = run.stderr.splitlines()
    assert line.startswith("cohortgate serve: --tokens-file ") and said in line, line


@pytest.mark.timeout(60)
def test_a_world_readable_tokens_file_starts_with_a_warning_naming_it(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} *\n")
    tokens.chmod(0o644)
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            *CLI,
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--port-file",
            str(port_file),
            "--metrics-listen",
            "off",
            "--history",
            "off",
            "--log-format",
            "json",
            "--tokens-file",
            str(tokens),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        warning = None
        for line in proc.stdout:
            event = json.loads(line)
            if event["level"] == "warning":
                warning = event["event"]
            if event["event"] == "serving":
                break
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert warning == (
        f"--tokens-file {tokens} has mode 644: others on this machine can read every token; "
        f"run chmod 600 {tokens}"
    )


# -- one source per setting: flags and variables generated from the settings models -----
# The flags as they were written by hand before they were generated (issue 24): the same
# set, each also a variable (and those added since: --stall-after, --pause-limit,
# --straggler-ratio).
SERVE_FLAGS = [
    "advertise",
    "allow-remote",
    "audit-timeout",
    "etcd",
    "etcd-ca",
    "etcd-cert",
    "etcd-key",
    "etcd-password-file",
    "etcd-prefix",
    "etcd-user",
    "grace",
    "history",
    "history-retention-days",
    "job-policy",
    "job-retention",
    "join-deadline",
    "leader-ttl",
    "listen",
    "log-format",
    "log-level",
    "manifest-timeout",
    "max-cohort-manifest-bytes",
    "max-cohorts",
    "max-manifest-bytes",
    "max-manifest-entries",
    "max-message-bytes",
    "max-upload-bytes",
    "max-waiting-ranks",
    "max-watchers",
    "max-watchers-per-token",
    "max-world-size",
    "metrics-listen",
    "pause-limit",
    "policy",
    "port-file",
    "progress-interval",
    "rank-grace",
    "stall-after",
    "straggler-ratio",
    "tls-cert",
    "tls-client-ca",
    "tls-key",
    "tokens-file",
    "watch-interval",
]
RELAY_FLAGS = [
    "audit-window",
    "listen",
    "local-ranks",
    "log-format",
    "log-level",
    "max-message-bytes",
    "port-file",
    "rank-grace",
    "settings-every",
    "tls-cert",
    "tls-client-ca",
    "tls-key",
    "upstream",
    "upstream-rpc",
    "window",
]


def _flags(command: str) -> dict[str, str]:
    """--flag -> its help, as `cohortgate COMMAND --help` has them."""
    import argparse

    from cohortgate.coordinator.cli.main import build_parser

    sub = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices[command]
    return {
        o.removeprefix("--"): a.help or ""
        for a in sub._actions
        for o in a.option_strings
        if o.startswith("--") and o != "--help"
    }


@pytest.mark.parametrize(
    ("command", "flags", "prefix"),
    [("serve", SERVE_FLAGS, "COHORTGATE_"), ("relay", RELAY_FLAGS, "COHORTGATE_RELAY_")],
)
def test_every_flag_is_the_one_it_was_and_names_its_variable_and_default(
    command: str, flags: list[str], prefix: str
) -> None:
    helps = _flags(command)
    assert sorted(helps) == sorted(flags)
    for flag, said in helps.items():
        # serve's own TLS is COHORTGATE_SERVE_TLS_* (COHORTGATE_TLS_* is a client's)
        own = "SERVE_" if command == "serve" and flag.startswith("tls-") else ""
        var = prefix + own + flag.upper().replace("-", "_")
        assert f"${var}" in said, (flag, said)
        assert "default: " in said or "required" in said, (flag, said)


def test_a_variable_sets_what_its_flag_sets_and_the_flag_wins() -> None:
    from cohortgate.coordinator.edge.config import ServeConfig
    from cohortgate.coordinator.edge.relay_config import RelayConfig
    from cohortgate.coordinator.edge.settings import from_env_and_flags

    env = {f"COHORTGATE_{f.upper().replace('-', '_')}": "" for f in SERVE_FLAGS}
    env |= {"COHORTGATE_JOIN_DEADLINE": "120", "COHORTGATE_POLICY": "code=strict"}
    serve = from_env_and_flags(ServeConfig, {}, env)
    assert serve.join_deadline == 120 and serve.policies.default == {"code": "strict"}
    assert from_env_and_flags(ServeConfig, {"join_deadline": 5.0}, env).join_deadline == 5.0
    for field in ServeConfig.model_fields:  # every field is read from its variable
        assert f"COHORTGATE_{field.upper()}" in env, field
    relay = from_env_and_flags(
        RelayConfig,
        {"upstream": "127.0.0.1:1"},
        {"COHORTGATE_RELAY_RANK_GRACE": "3", "COHORTGATE_RELAY_WINDOW": "0.5"},
    )
    assert (relay.rank_grace, relay.window) == (3.0, 0.5)


def test_the_relays_server_tls_is_never_the_clients_certificate(pki: Path) -> None:
    """COHORTGATE_TLS_CERT/_KEY are a client's certificate (the relay's upstream, an
    agent's): the relay's own port reads COHORTGATE_RELAY_TLS_* only."""
    from cohortgate.coordinator.edge.relay_config import RelayConfig
    from cohortgate.coordinator.edge.settings import from_env_and_flags

    client = {"COHORTGATE_TLS_CERT": str(pki / "client.pem"), "COHORTGATE_TLS_KEY": "x"}
    relay = from_env_and_flags(RelayConfig, {"upstream": "127.0.0.1:1"}, client)
    assert not relay.tls.on
    own = client | {
        "COHORTGATE_RELAY_TLS_CERT": str(pki / "server.pem"),
        "COHORTGATE_RELAY_TLS_KEY": str(pki / "server.key"),
    }
    relay = from_env_and_flags(RelayConfig, {"upstream": "127.0.0.1:1"}, own)
    assert relay.tls.cert == pki / "server.pem" and relay.tls.mode == "on"


@pytest.mark.parametrize(
    ("where", "addr"),
    [("COHORTGATE_ADDR", "localhost"), ("--addr", "http://127.0.0.1:17070"), ("--addr", "a:1,b")],
)
def test_the_cli_checks_an_address_as_the_agent_does(where: str, addr: str) -> None:
    """`cohortgate status` given "localhost" tried port 443 in silence, and a URL gave a raw
    resolver error: one line naming the setting, exit 2."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "cohortgate.coordinator.cli", "status"]
    if where == "--addr":
        args += ["--addr", addr]
    else:
        env["COHORTGATE_ADDR"] = addr
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    said = f"${where}={addr!r}: " if where.startswith("COHORTGATE") else f"{where}: "
    assert line.startswith(f"cohortgate status: {said}"), line
    assert "is not HOST:PORT" in line or "empty" in line, line


def test_the_servers_tls_has_its_own_variables_and_the_old_ones_still_work_with_a_warning(
    pki: Path,
) -> None:
    """Issue 38: COHORTGATE_TLS_CERT/_KEY meant the server's certificate for `serve` and a
    client's for everything else. `serve` reads COHORTGATE_SERVE_TLS_*; the old names for
    one release, saying the new one; the new name wins where both are set."""
    from cohortgate.coordinator.edge.config import ServeConfig
    from cohortgate.coordinator.edge.settings import from_env_and_flags

    cert, key = str(pki / "server.pem"), str(pki / "server.key")
    said: list[str] = []
    new = {"COHORTGATE_SERVE_TLS_CERT": cert, "COHORTGATE_SERVE_TLS_KEY": key}
    serve = from_env_and_flags(ServeConfig, {}, new, warn=said.append)
    assert (serve.tls.cert, serve.tls.key, said) == (Path(cert), Path(key), [])

    old = {"COHORTGATE_TLS_CERT": cert, "COHORTGATE_TLS_KEY": key}
    serve = from_env_and_flags(ServeConfig, {}, old, warn=said.append)
    assert (serve.tls.cert, serve.tls.key) == (Path(cert), Path(key))
    assert said == [
        f"COHORTGATE_TLS_{k} for the server is deprecated: use COHORTGATE_SERVE_TLS_{k} "
        f"(COHORTGATE_TLS_{k} keeps its meaning for clients: agents, relays upstream and the CLI)"
        for k in ("CERT", "KEY")
    ]

    said.clear()
    both = (
        old
        | {"COHORTGATE_SERVE_TLS_CERT": str(pki / "client.pem")}
        | {"COHORTGATE_SERVE_TLS_KEY": str(pki / "client.key")}
    )
    serve = from_env_and_flags(ServeConfig, {}, both, warn=said.append)
    assert (serve.tls.cert, said) == (pki / "client.pem", [])
    # A flag given wins and needs no warning about the variable it overrides.
    flags = {"tls_cert": cert, "tls_key": key}
    serve = from_env_and_flags(ServeConfig, flags, old, warn=said.append)
    assert (serve.tls.cert, said) == (Path(cert), [])
