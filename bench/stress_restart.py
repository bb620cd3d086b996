"""The restart race under load: 64 jobs x 8 simulated gRPC ranks, and in every fourth job
rank 7 joins, cancels its call and re-joins at once as a new incarnation (what a torchrun
restart does). Every rank of every job must end with one verdict, FORMED, one cohort.

    python bench/stress_restart.py --runs 20 --burners 2
    python bench/stress_restart.py --runs 20 --shape lone --no-launch [--relay]

--shape lone: rank 7 is restarted alone (its first process dies right after its first
event, the new one joins 50 ms later); --no-launch: ranks started without torchrun;
--relay: ranks 4-7 of every job join through a `cohortgate relay` (tests/restarts.py).

Each run starts a fresh `cohortgate serve` (production settings: SQLite history, metrics,
info logs) and, with --burners, that many CPU-burning processes beside it. Prints one line
per run and a JSON summary; exits 1 if any rank of any run ended otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cohortgate.coordinator.cli.spawn import spawn
from tests.restarts import Load, run_load


def burn() -> None:
    while True:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs in a row (default 20)")
    parser.add_argument("--jobs", type=int, default=64, help="jobs per run (default 64)")
    parser.add_argument("--world", type=int, default=8, help="ranks per job (default 8)")
    parser.add_argument(
        "--every", type=int, default=4, help="every Nth job has a restarted rank (default 4)"
    )
    parser.add_argument(
        "--burners", type=int, default=2, help="CPU-burning processes beside (default 2)"
    )
    parser.add_argument(
        "--shape",
        choices=("torchrun", "lone"),
        default="torchrun",
        help="torchrun: the restart cancels and re-joins at once; lone: it dies right after "
        "its first event and the new process joins 50 ms later (default torchrun)",
    )
    parser.add_argument(
        "--no-launch", action="store_true", help="ranks name no launch (started without torchrun)"
    )
    parser.add_argument(
        "--relay", action="store_true", help="ranks 4-7 of every job join through a relay"
    )
    parser.add_argument("--log-dir", type=Path, help="keep each run's coordinator log here")
    args = parser.parse_args()
    burners = [mp.Process(target=burn, daemon=True) for _ in range(args.burners)]
    for b in burners:
        b.start()
    failed_runs = 0
    summary = []
    try:
        for run in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                log = open(Path(tmp) / "coordinator.log", "wb")  # noqa: SIM115
                proc, port = spawn(
                    Path(tmp) / "port",
                    [
                        "--history",
                        f"{tmp}/history.sqlite",
                        "--metrics-listen",
                        "127.0.0.1:0",
                        "--log-format",
                        "json",
                        "--join-deadline",
                        "120",
                    ],
                    stdout=log,
                )
                relay = None
                try:
                    relay_addr = ""
                    if args.relay:
                        relay, relay_port = spawn(
                            Path(tmp) / "relay-port",
                            [
                                *("--upstream", f"127.0.0.1:{port}", "--listen", "127.0.0.1:0"),
                                *("--local-ranks", str(args.world // 2), "--log-format", "json"),
                            ],
                            stdout=log,
                            command="relay",
                        )
                        relay_addr = f"127.0.0.1:{relay_port}"
                    start = time.monotonic()
                    load = Load(
                        args.jobs,
                        args.world,
                        args.every,
                        args.shape,
                        not args.no_launch,
                        relay=relay_addr,
                    )
                    problems = asyncio.run(run_load(f"127.0.0.1:{port}", load, run))
                    took = time.monotonic() - start
                finally:
                    for p in (relay, proc):
                        if p is not None:
                            p.terminate()
                            p.wait(timeout=30)
                    log.close()
                    if args.log_dir is not None:
                        args.log_dir.mkdir(parents=True, exist_ok=True)
                        (args.log_dir / f"run{run}.log").write_bytes(
                            (Path(tmp) / "coordinator.log").read_bytes()
                        )
            failed_runs += bool(problems)
            summary.append({"run": run, "seconds": round(took, 2), "problems": problems})
            state = "ok" if not problems else f"{len(problems)} job(s) wrong"
            print(f"run {run + 1}/{args.runs}: {took:.1f} s, {state}", flush=True)
            for p in problems[:5]:
                print(f"  {p}", flush=True)
    finally:
        for b in burners:
            b.terminate()
    print(json.dumps({"runs": args.runs, "failed_runs": failed_runs, "results": summary}))
    return 1 if failed_runs else 0


if __name__ == "__main__":
    raise SystemExit(main())
