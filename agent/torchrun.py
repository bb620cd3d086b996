"""What torchrun tells a worker (its environment) and how a worker tells torchrun why it died."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cohortgate.coordinator.contract.addr import DEFAULT_ADDR, split_host_port

if TYPE_CHECKING:
    import grpc


def say(text: str) -> None:
    """`text` and its newline on stderr in one write: a rank's report is several lines, and
    print() writes the text and the newline apart, so the ranks sharing a terminal (or
    torchrun's pipe) could interleave their lines."""
    import sys

    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class CohortgateError(RuntimeError):
    """The join failed for a reason other than a refusal (a setting, an unreachable
    coordinator, an error it returned): the message says which and what to do."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class AgentConfigError(CohortgateError):
    """The rank's environment does not say enough to join; the message says what to set."""


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise AgentConfigError(
                f"{name} is not set: launch with torchrun (or set {name}) so the agent knows "
                "this process's place in the job"
            )
        return default
    try:
        return int(raw)
    except ValueError:
        raise AgentConfigError(f"{name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class RankIdentity:
    """Who this process is in the job, read once from torchrun's variables."""

    job_id: str
    rank: int
    world_size: int
    local_rank: int
    host: str
    pid: int
    incarnation: str
    restart_count: int
    addr: str
    error_file: str | None
    endpoint_host: str
    launch: str = ""
    elastic: bool = False  # a worker of torchrun's elastic agent (TORCHELASTIC_RUN_ID)

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        job_id: str | None = None,
        addr: str | None = None,
    ) -> RankIdentity:
        env = os.environ if env is None else env
        job = job_id or env.get("COHORTGATE_JOB") or env.get("TORCHELASTIC_RUN_ID") or ""
        if not job or job == "none":
            raise AgentConfigError(
                "no job id: torchrun's TORCHELASTIC_RUN_ID is unset or 'none'. Launch with "
                "`torchrun --rdzv-id JOB ...` or `--standalone`, use `cohortgate run`, or set "
                "COHORTGATE_JOB to the same value on every rank"
            )
        rank = _int(env, "RANK")
        world_size = _int(env, "WORLD_SIZE")
        if not 0 <= rank < world_size:
            raise AgentConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
        coordinator = addr or env.get("COHORTGATE_ADDR") or DEFAULT_ADDR
        try:  # one address, or the replicas of an active/standby coordinator: a:7070,b:7070
            for one in coordinator.split(","):
                split_host_port(one.strip())
        except ValueError as exc:
            where = "addr=" if addr else "COHORTGATE_ADDR="
            raise AgentConfigError(f"{where}{coordinator!r}: {exc}") from None
        host = socket.gethostname()
        return cls(
            job_id=job,
            rank=rank,
            world_size=world_size,
            local_rank=_int(env, "LOCAL_RANK", 0),
            host=host,
            pid=os.getpid(),
            incarnation=uuid.uuid4().hex,
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
            addr=coordinator,
            error_file=env.get("TORCHELASTIC_ERROR_FILE") or None,
            endpoint_host=env.get("COHORTGATE_ENDPOINT_HOST") or env.get("MASTER_ADDR") or host,
            launch=launch_of(env, host),
            elastic=bool(env.get("TORCHELASTIC_RUN_ID")),
        )


def launch_of(env: Mapping[str, str], host: str) -> str:
    """Which launch of the job this process belongs to, the same on every node of it:
    COHORTGATE_LAUNCH, else torchrun's store endpoint (MASTER_ADDR:MASTER_PORT, shared by
    all nodes of one launch; two launches that reuse a job id have different ones). A
    static launch with --master-port 0 (one node) is named by its torchrun process."""
    if env.get("COHORTGATE_LAUNCH"):
        return env["COHORTGATE_LAUNCH"]
    if not env.get("TORCHELASTIC_RUN_ID"):
        return ""  # not under torchrun: nothing to tell launches apart by
    master = _master(env)
    return f"{master[0]}:{master[1]}" if master else f"{host}/torchrun-{os.getppid()}"


def _master(env: Mapping[str, str]) -> tuple[str, int] | None:
    """torchrun's store endpoint (MASTER_ADDR, MASTER_PORT). None where there is none: a
    static launch with --master-port 0 hands its workers port 0, and no store is there."""
    host, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
    return (host, int(port)) if host and port.isdigit() and int(port) else None


def torchrun_store(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """(host, port) of the store torchrun's agent hosts for its workers, when it shares one."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return _master(env)


def free_port(host: str = "") -> int:
    """A port free on this host now, for the cohort's rendezvous store (rank 0 offers it).

    The socket is closed before the store binds it; another process could take the port in
    between, which init_process_group would then report as 'address in use'.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_error_file(path: str | None, summary: str, report: str) -> None:
    """Write torchrun's error-file format so its 'Root Cause' shows our report.

    torchrun prints extraInfo.py_callstack for the first failed rank; we put the report
    there, since a Python traceback of cohortgate.join() would tell the reader nothing.
    """
    if not path:
        return
    data = {
        "message": {
            "message": summary,
            "extraInfo": {"py_callstack": report, "timestamp": str(int(time.time()))},
        }
    }
    # Whole or not at all: torchrun SIGTERMs the other ranks as soon as one exits, and a
    # rank killed halfway through its write left an empty file that torchrun's parser
    # crashed on, printing no Root Cause at all (1 run in ~25 of the strict exit-hook e2e).
    # A temporary file beside it, then an atomic rename.
    partial = f"{path}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as fp:
            json.dump(data, fp)
        os.replace(partial, path)
    except OSError:
        pass  # the report still goes to stderr; a read-only error file must not hide it
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial)


def audit_every() -> int:
    """COHORTGATE_AUDIT_EVERY: audit only the steps that are a multiple of it (default 1:
    every call). The same on every rank, so the ranks audit the same steps."""
    text = os.environ.get("COHORTGATE_AUDIT_EVERY", "").strip() or "1"
    if not text.isdigit() or int(text) < 1:
        raise AgentConfigError(
            f"COHORTGATE_AUDIT_EVERY={text!r} is not a whole number of steps >= 1 (audit "
            "every Nth step; unset audits every step)"
        )
    return int(text)


class CohortStalled(RuntimeError):
    """No rank of the cohort reached a new step within the stall bound, under `--policy
    stall=strict`: the report says which rank is where. Raised by cohort.step()."""

    def __init__(self, headline: str, report: str) -> None:
        super().__init__(f"{headline}\n{report}")
        self.headline, self.report = headline, report


class ReplicasDiverged(RuntimeError):
    """Replicas that must hold the same weights differ, under `--policy audit=strict`: every
    rank raises it at the same stop step, with the same report."""

    def __init__(self, step: int, headline: str, report: str) -> None:
        super().__init__(f"{headline}\n{report}")
        self.step, self.headline, self.report = step, headline, report
