"""The main demo: one coordinator, a 4-rank torchrun job that forms and trains, then a job
with one mismatching rank that every rank refuses with the same report."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from cohortgate.coordinator.cli.spawn import spawn
from cohortgate.coordinator.edge.config import runs_dir

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train.py"


def banner(text: str) -> None:
    print(f"\n{'=' * 78}\n== {text}\n{'=' * 78}", flush=True)


def demo_history() -> Path:
    """Kept after the demo, where `cohortgate explain JOB ROUND` looks (the run histories,
    pruned after the history retention as `cohortgate run`'s are)."""
    return runs_dir() / "demo.sqlite"


def start_coordinator(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    history = demo_history()
    history.parent.mkdir(parents=True, exist_ok=True)
    history.unlink(missing_ok=True)  # this demo's jobs only: rounds start at 1
    flags = [
        "--join-deadline",
        "60",
        "--log-format",
        "console",
        "--metrics-listen",
        "127.0.0.1:0",
        "--history",
        str(history),
    ]
    proc, port = spawn(tmp / "port", flags)
    return proc, f"127.0.0.1:{port}"


def torchrun(addr: str, job: str, *args: str) -> int:
    env = {**os.environ, "COHORTGATE_ADDR": addr, "COHORTGATE_JOB": job, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "4",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "0",
        str(TRAIN),
        *args,
    ]
    print(shown_command(addr, job, cmd), flush=True)
    return subprocess.run(cmd, env=env, check=False).returncode


def shown_command(addr: str, job: str, cmd: list[str]) -> str:
    """The command as run, in the words a user would type it: `torchrun` for
    `python -m torch.distributed.run`, the script relative to the checkout."""
    words = ["torchrun" if w == "torch.distributed.run" else w for w in cmd[2:]]
    words = [os.path.relpath(w) if w == str(TRAIN) else w for w in words]
    env = f"COHORTGATE_ADDR={addr} COHORTGATE_JOB={job} OMP_NUM_THREADS=1"
    return "$ " + " ".join([env, *(shlex.quote(w) for w in words)])


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="cohortgate-demo-") as tmp:
        banner("starting the coordinator")
        coordinator, addr = start_coordinator(Path(tmp))
        try:
            banner("job 1: four ranks, identical models -> formed, trains 5 steps")
            formed = torchrun(addr, "demo-good", "--steps", "5")
            banner("job 2: rank 2 builds a wider hidden layer -> refused on every rank")
            refused = torchrun(addr, "demo-mismatch", "--wide-rank", "2")
            banner(
                "job 3: same model everywhere, but rank 1 resumes from another step -> refused "
                "by the facts check"
            )
            facts = torchrun(addr, "demo-facts", "--resume-rank", "1")
        finally:
            coordinator.send_signal(signal.SIGTERM)
            coordinator.wait(timeout=30)
    banner("summary")
    first = "FORMED" if formed == 0 else "FAILED"
    second = "REFUSED" if refused else "FORMED?!"
    print(f"job 1 (identical models): torchrun exit code {formed} -> {first}")
    third = "REFUSED" if facts else "FORMED?!"
    print(f"job 2 (rank 2 wider):     torchrun exit code {refused} -> {second}")
    print(f"job 3 (rank 1's facts):   torchrun exit code {facts} -> {third}")
    ok = formed == 0 and refused != 0 and facts != 0
    print("the refusals again, from the history it kept: cohortgate explain demo-mismatch 1")
    print("demo", "succeeded" if ok else "did NOT behave as expected")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
