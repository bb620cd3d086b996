"""Real processes for the tests: a coordinator, torchrun launches (one machine as two
nodes), agent ranks, and what stops, freezes and kills them, whole process groups at once."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.contract.layout import Layout
from cohortgate.coordinator.contract.manifest import Manifest
from tests.helpers import REPO


@contextlib.contextmanager
def coordinator_process(
    *flags: str,
    tmp: Path,
    listen: str = "127.0.0.1:0",
    wrap: Callable[[list[str], Path], list[str]] | None = None,
) -> Iterator[tuple[str, Path]]:
    """`cohortgate serve` as a real subprocess on a free port; yields (addr, log path).
    `wrap(command, port_file)` may run the command inside something (a mount namespace)."""
    port_file = tmp / f"port-{uuid.uuid4().hex[:6]}"
    log = tmp / f"coordinator-{uuid.uuid4().hex[:6]}.log"
    command = [
        sys.executable,
        "-m",
        "cohortgate.coordinator.cli",
        "serve",
        "--listen",
        listen,
        "--port-file",
        str(port_file),
        "--metrics-listen",
        "127.0.0.1:0",
        "--history",
        str(tmp / "history.sqlite"),
        "--log-format",
        "json",
        *flags,
    ]
    if wrap is not None:
        command = wrap(command, port_file)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        give_up = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError(f"coordinator did not start: {log.read_text()}")
            time.sleep(0.05)
        yield f"127.0.0.1:{port_file.read_text().split()[0]}", log
    finally:
        kill_group(proc)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """End a process started with start_new_session=True and everything it started."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def freeze(pid: int, *, group: bool = False, within: float = 10.0) -> None:
    """SIGSTOP a process (or its whole process group) and return once every thread of it is
    stopped. kill() only queues the stop: until the kernel has stopped each thread, one that
    is already awake can still answer a request sent right after (a "hung" etcd that served
    the test's call under load)."""
    if group:
        os.killpg(pid, signal.SIGSTOP)
    else:
        os.kill(pid, signal.SIGSTOP)
    give_up = time.monotonic() + within
    while True:
        running = [t for p in (_group_of(pid) if group else [pid]) for t in _running_threads(p)]
        if not running:
            return
        assert time.monotonic() < give_up, f"threads {running} of {pid} not stopped in {within} s"
        time.sleep(0.01)


def _group_of(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
    return pids


def _running_threads(pid: int) -> list[str]:
    """The threads of `pid` not (yet) stopped: state field of /proc/PID/task/TID/stat."""
    running = []
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                state = stat.rsplit(")", 1)[1].split()[0]  # after "(comm)", which may hold spaces
                if state not in ("T", "t", "Z", "X"):
                    running.append(tid)
    return running


def kill_job_workers(job: str) -> list[int]:
    """SIGKILL every process of this machine whose environment names torchrun job `job`
    (TORCHELASTIC_RUN_ID): torchrun starts its workers in sessions of their own, so ending a
    launch's process group misses a worker that outlived its agent, and a SIGSTOPped one
    ignores the SIGTERM its agent sends. The pids killed."""
    wanted = f"TORCHELASTIC_RUN_ID={job}".encode()
    killed = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if wanted in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
    return killed


# -- real launches ----------------------------------------------------------------------
TRAIN = REPO / "examples" / "train.py"


def launch_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of one launch (one node): its own TMPDIR and HOME (so `cohortgate
    run`'s history and anything else written under ~ stays in the test's directory),
    unbuffered, one thread."""
    tmpdir = tmp / f"tmp-{uuid.uuid4().hex[:6]}"
    tmpdir.mkdir()
    return {
        **sandboxed_env(tmp),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "TMPDIR": str(tmpdir),
        **extra,
    }


def sandboxed_env(tmp: Path) -> dict[str, str]:
    """This process's environment with HOME (and the XDG state, config and data directories)
    under `tmp`: a subprocess of a test writes nothing to the user's home directory. The
    cache stays the session's (tests/conftest.py puts it in a temporary directory too), so
    that every launch does not start cold."""
    home = tmp / "home"
    home.mkdir(exist_ok=True)
    kinds = ("STATE", "CONFIG", "DATA")
    xdg = {f"XDG_{kind}_HOME": str(home / f".{kind.lower()}") for kind in kinds}
    return {**os.environ, "HOME": str(home), **xdg}


def one_node_args(script: Path, *script_args: str, nproc: int = 4) -> list[str]:
    """torchrun's arguments for a single-node job of `nproc` ranks on this machine."""
    return [
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "0",
        "--monitor-interval",
        "0.2",
        str(script),
        *script_args,
    ]


def two_node_args(rdzv: str, job: str, script: Path, *script_args: str) -> list[str]:
    """torchrun's arguments for one of two nodes (2 ranks each) of `job` on this machine."""
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        rdzv,
        "--rdzv-id",
        job,
        "--monitor-interval",
        "0.2",
        str(script),
        *script_args,
    ]


def launch(
    args: Sequence[str], env: dict[str, str], cwd: Path, *, via: str = "torchrun"
) -> subprocess.Popen[str]:
    """`torchrun ARGS` (or `cohortgate run ARGS`, via="cohortgate run") in its own session,
    stdout and stderr together; end it with `finish` (or `kill_group`)."""
    command = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
        "cohortgate run": [sys.executable, "-m", "cohortgate.coordinator.cli", "run"],
    }[via]
    return session([*command, *args], cwd=cwd, env=env)


def session(command: Sequence[str], **popen: Any) -> subprocess.Popen[str]:
    """`command` in its own session (end it with `kill_group`), its stdout and stderr
    together as text on `.stdout`."""
    return subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **popen,
    )


def program(name: str) -> str:
    """The path of a system program the suite drives (Debian's, installed by make test)."""
    path = shutil.which(name)
    assert path, f"Debian's {name} is required (make system-deps installs it)"
    return path


def finish(procs: list[subprocess.Popen[str]], timeout: float = 240) -> list[str]:
    """Each launch's output once it ended; every process group is gone afterwards."""
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outs.append(out)
    finally:
        for proc in procs:
            kill_group(proc)
    return outs


def torchrun(
    addr: str,
    job: str,
    *script_args: str,
    tmp: Path,
    nproc: int = 4,
    script: Path = TRAIN,
) -> subprocess.CompletedProcess[str]:
    """A single-node torchrun job of `nproc` gloo ranks joining `addr` as `job`."""
    env = launch_env(tmp, COHORTGATE_ADDR=addr, COHORTGATE_JOB=job, MASTER_ADDR="127.0.0.1")
    proc = launch(one_node_args(script, *script_args, nproc=nproc), env, tmp)
    (out,) = finish([proc], timeout=170)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def agent_rank(
    addr: str,
    job: str,
    rank: int,
    world: int,
    m: Manifest,
    timeout_s: float = 60,
    digests: list[bytes] | None = None,
    sharded_without_layout: bool = False,
    layout: Layout | None = None,
    backoff_max_s: float = 0.5,
) -> pb.Verdict:
    """One rank through the agent's real join client (retries, backoff), without torch.
    `backoff_max_s`: 0.5 s for quick tests; the agent's own default is 5 s."""
    from cohortgate.agent.client import JoinOptions, join
    from cohortgate.agent.torchrun import RankIdentity

    identity = RankIdentity(
        job_id=job,
        rank=rank,
        world_size=world,
        local_rank=rank % 8,
        host=f"node{rank // 8}",
        pid=1000 + rank,
        incarnation=f"{job}-{rank}",
        restart_count=0,
        addr=addr,
        error_file=None,
        endpoint_host="127.0.0.1",
    )
    return join(
        identity,
        m,
        init_method="tcp://127.0.0.1:29500" if rank == 0 else "",
        runtime=pb.RuntimeFacts(),
        options=JoinOptions(timeout_s=timeout_s, backoff_max_s=backoff_max_s),
        digests=digests,
        sharded_without_layout=sharded_without_layout,
        layout=layout,
    )
