"""Run the formed 4-rank torchrun job N times in a row (optionally with the CPUs kept busy)
and count the runs that did not end cleanly: a teardown that aborts one run in eight is a
bug, not noise. Prints one line per failure and a summary; writes JSON with --json.

    python bench/stress_e2e.py --runs 50 --busy 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cohortgate.coordinator.cli.spawn import spawn  # noqa: E402

TRAIN = REPO / "examples" / "train.py"


def _burn(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x ^= i * i


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="torchrun launches (default 50)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks per launch (default 4)")
    parser.add_argument(
        "--busy", type=int, default=0, help="processes spinning on the CPUs meanwhile (default 0)"
    )
    parser.add_argument("--steps", type=int, default=3, help="DDP steps per run (default 3)")
    parser.add_argument(
        "--rdzv",
        choices=["static", "c10d"],
        default="static",
        help="static: --master-port 0 (rank 0 hosts the cohort's store); c10d: torchrun's "
        "agent hosts it (default static)",
    )
    parser.add_argument(
        "--refuse",
        action="store_true",
        help="rank 1 declares another resume step: every run must be refused by the facts "
        "check on every rank, without a hang (default: every run forms and trains)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(stop,)) for _ in range(args.busy)]
    for b in burners:
        b.start()
    failures: list[dict[str, object]] = []
    durations: list[float] = []
    with tempfile.TemporaryDirectory(prefix="cohortgate-stress-") as tmp:
        coordinator, port = spawn(
            Path(tmp) / "port",
            ["--metrics-listen", "off", "--history", "off", "--log-level", "warning"],
            stdout=subprocess.DEVNULL,
        )
        env = {
            **os.environ,
            "COHORTGATE_ADDR": f"127.0.0.1:{port}",
            "OMP_NUM_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",  # an abort prints every thread's Python stack
        }
        try:
            rdzv = (
                ["--master-addr", "127.0.0.1", "--master-port", "0"]
                if args.rdzv == "static"
                else ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
            )
            for i in range(args.runs):
                env["COHORTGATE_JOB"] = f"stress-{i}"
                started = time.monotonic()
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--nproc-per-node",
                        str(args.nproc),
                        *rdzv,
                        str(TRAIN),
                        "--steps",
                        str(args.steps),
                        *(["--resume-rank", "1"] if args.refuse else []),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=False,
                )
                durations.append(time.monotonic() - started)
                out = proc.stdout + proc.stderr
                trained = len(re.findall(r"trained \d+ steps", out))
                refused = len(re.findall(r"cohort refused: ranks disagree on declared facts", out))
                clean = (
                    proc.returncode != 0 and refused == args.nproc
                    if args.refuse
                    else proc.returncode == 0 and trained == args.nproc
                )
                if not clean or "terminate called" in out:
                    failures.append({"run": i, "code": proc.returncode, "output": out})
                    print(f"run {i}: FAILED (exit {proc.returncode}, {trained} ranks trained)")
                    print(out[-4000:])
                else:
                    print(f"run {i}: ok ({durations[-1]:.1f}s)", flush=True)
        finally:
            coordinator.terminate()
            coordinator.wait(timeout=30)
            stop.set()
            for b in burners:
                b.join()
    ok = args.runs - len(failures)
    print(f"{ok}/{args.runs} runs clean ({args.nproc} ranks, {args.busy} busy processes)")
    if args.json:
        args.json.write_text(
            json.dumps({"runs": args.runs, "clean": ok, "failures": failures, "s": durations})
        )
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
