"""Shared fixtures: a real in-process coordinator per test, and the test-wide settings."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Tests start subprocesses that import the project from the checkout.
os.environ.setdefault("PYTHONPATH", str(REPO))

# Nothing a test runs (in this process or a subprocess) writes to the user's home: HOME and
# the XDG directories are a temporary directory of the session's, removed at its end
# (`cohortgate run` keeps its history under ~/.local/state/cohortgate otherwise).
SANDBOX_HOME = Path(tempfile.mkdtemp(prefix="cohortgate-tests-home-"))
os.environ["HOME"] = str(SANDBOX_HOME)
for _kind in ("STATE", "CACHE", "CONFIG", "DATA"):
    os.environ[f"XDG_{_kind}_HOME"] = str(SANDBOX_HOME / f".{_kind.lower()}")


# Hypothesis keeps its example database, constants cache and failure patches in
# ./.hypothesis by default: the checkout. They go to the sandbox too (a failing example is
# printed in full, so nothing needed for a rerun is lost).
import functools  # noqa: E402
from typing import Any  # noqa: E402

import grpc  # noqa: E402
import hypothesis.configuration  # noqa: E402

# Every channel the test process opens (the tests', their helpers', the in-process relays'
# and hops') gets a subchannel pool of its own. grpc shares subchannels by address across a
# process's channels; a worker starts and stops hundreds of in-process servers on ports the
# kernel hands out again, so a new channel to a new server could share an earlier channel's
# subchannel to a stopped one, in back-off, and fail at once with its stale "Connection
# refused" while the new server listens (two full runs failed so, on different tests).


def _own_subchannels(open_channel: Any, at: int) -> Any:
    """`open_channel` with the option added; `at`: where its options come positionally."""

    @functools.wraps(open_channel)
    def opened(*args: Any, **kw: Any) -> Any:
        if len(args) > at:
            args, kw = args[:at], {**kw, "options": args[at]}
        own = [*(kw.pop("options", None) or ()), ("grpc.use_local_subchannel_pool", 1)]
        return open_channel(*args, options=own, **kw)

    return opened


for _module in (grpc, grpc.aio):
    for _name, _at in (("insecure_channel", 1), ("secure_channel", 2)):
        setattr(_module, _name, _own_subchannels(getattr(_module, _name), _at))

hypothesis.configuration.set_hypothesis_home_dir(str(SANDBOX_HOME / ".hypothesis"))


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(SANDBOX_HOME, ignore_errors=True)


# In-process coordinators log through structlog; keep only warnings in the test output
# (tests that read logs run the coordinator as a subprocess with JSON logs).
from cohortgate.coordinator.cli import logs  # noqa: E402
from tests.contract import Clock  # noqa: E402
from tests.etcd import EtcdServer, etcd_server  # noqa: E402
from tests.helpers import InProcessCoordinator  # noqa: E402

logs.configure("console", "warning")


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost, and a client certificate."""
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=cohortgate test CA",
        cwd=d,
    )
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN={name}",
            cwd=d,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            cwd=d,
        )
    return d


@pytest.fixture
def coord(request: pytest.FixtureRequest) -> Iterator[InProcessCoordinator]:
    """A real coordinator on a free loopback port. A test module sets JOIN_DEADLINE (seconds)
    where its tests wait out, or must not wait out, the deadline; the default is 30 s."""
    c = InProcessCoordinator(
        join_deadline=getattr(request.module, "JOIN_DEADLINE", 30.0), progress_interval=0.2
    )
    yield c
    c.stop()


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """The test session's etcd (each test takes a key prefix of its own: tests.etcd.prefix)."""
    with etcd_server(tmp_path_factory.mktemp("etcd")) as server:
        yield server


@pytest.fixture
def clock() -> Clock:
    """Wall time, moved by hand (the contract suites' stores and verdicts)."""
    return Clock()
