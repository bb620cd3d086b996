"""A real etcd server for the tests: Debian's etcd-server (3.4), on free loopback ports with
a temporary data directory, started per test session (or per test, for tests that kill
it) and stopped after. `make system-deps` unpacks the package without its system service."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import free_port
from tests.launches import freeze, kill_group, program

# etcd is started through this: a process with no threads of its own asks the kernel for
# SIGKILL when the test thread that started it ends (PR_SET_PDEATHSIG, kept across exec),
# then becomes etcd. A test process killed outright (a timeout's SIGKILL, a mutation run
# stopping its workers) never runs the fixture's teardown: its etcd went on running.
DIE_WITH_PARENT = (
    sys.executable,
    "-c",
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
    "os.execv(sys.argv[1], sys.argv[1:])",
)


class EtcdServer:
    """One etcd member on 127.0.0.1; `kill()` and `start()` again keep its ports and data."""

    def __init__(self, data: Path, pki: Path | None = None) -> None:
        self.data = data
        self.pki = pki  # serve clients over TLS with pki's server certificate
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data.with_suffix(".log")

    @property
    def endpoint(self) -> str:
        return f"{'https' if self.pki else 'http'}://127.0.0.1:{self.client_port}"

    def start(self, wait: bool = True) -> EtcdServer:
        client, peer = self.endpoint, f"http://127.0.0.1:{self.peer_port}"
        tls = []
        if self.pki is not None:
            tls = [
                "--cert-file",
                str(self.pki / "server.pem"),
                "--key-file",
                str(self.pki / "server.key"),
            ]
        name = "cg-test"
        command = [
            *DIE_WITH_PARENT,
            program("etcd"),
            "--name",
            name,
            "--data-dir",
            str(self.data),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{name}={peer}",
            "--initial-cluster-state",
            "new",
            # no metrics or debug listeners of its own: loopback only, nothing else
            "--log-level",
            "warn",
            *tls,
        ]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "ETCD_UNSUPPORTED_ARCH": os.uname().machine},
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        import grpc

        from cohortgate.coordinator.etcd import etcd_pb2 as epb
        from cohortgate.coordinator.etcd import etcd_pb2_grpc as epb_grpc

        give_up = time.monotonic() + timeout
        target = f"127.0.0.1:{self.client_port}"
        if self.pki is not None:
            ca = grpc.ssl_channel_credentials((self.pki / "ca.pem").read_bytes())
            channel = grpc.secure_channel(target, ca)
        else:
            channel = grpc.insecure_channel(target)
        with channel:
            kv = epb_grpc.KVStub(channel)
            while True:
                try:
                    kv.Range(epb.RangeRequest(key=b"ready?"), timeout=1.0)
                    return
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                        return  # up, with authentication on
                    assert self.proc is not None
                    if self.proc.poll() is not None or time.monotonic() > give_up:
                        raise RuntimeError(f"etcd did not start: {self.log.read_text()}") from None
                    time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None

    def etcdctl(self, *args: str) -> str:
        """Debian's etcdctl against this member (as root, once authentication is on)."""
        tls = ["--cacert", str(self.pki / "ca.pem")] if self.pki is not None else []
        done = subprocess.run(
            [program("etcdctl"), "--endpoints", self.endpoint, *tls, *args],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "ETCDCTL_API": "3"},
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def pause(self) -> None:
        """SIGSTOP: a hung etcd, whose connections stay open and answer nothing."""
        assert self.proc is not None
        freeze(self.proc.pid, group=True)

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            kill_group(self.proc)
            self.proc = None


@contextlib.contextmanager
def etcd_server(tmp: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp / f"etcd-{uuid.uuid4().hex[:6]}").start()
    try:
        yield server
    finally:
        server.stop()


def prefix() -> str:
    """A key prefix of its own for one test on the session's etcd."""
    return f"/cg-test-{uuid.uuid4().hex[:8]}/"
