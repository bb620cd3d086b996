"""Coordinator memory with many large manifests: one job of N ranks, each with its own
100k-entry model (N distinct signatures, N manifests uploaded), refused with diffs.
Prints the coordinator's RSS before, at its peak while the manifests are held, and after
each job's verdict (--jobs of them, one after the other: what one job leaves behind).

Usage: python bench/bench_memory.py [--ranks 10] [--entries 100000] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cohortgate.coordinator.cli.spawn import spawn
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from tests.helpers import join_request, run_rank, save_figures


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def model(entries: int, variant: int) -> Manifest:
    return Manifest.of(
        Entry(
            Kind.PARAMETER, f"model.layers.{i // 8}.p{i % 8}", "bfloat16", (64, 64 + variant), True
        )
        for i in range(entries)
    )


def run_job(addr: str, job: str, models: list[Manifest]) -> list[Any]:
    with ThreadPoolExecutor(len(models)) as pool:
        return list(
            pool.map(
                lambda r: run_rank(
                    addr, join_request(job, r, len(models), models[r]), models[r], 300
                ),
                range(len(models)),
            )
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=10)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument(
        "--jobs", type=int, default=3, help="jobs run one after the other (RSS after each)"
    )
    parser.add_argument("--json", type=Path, default=Path("bench/results/memory.json"))
    args = parser.parse_args()
    models = [model(args.entries, v) for v in range(args.ranks)]
    with tempfile.TemporaryDirectory(prefix="cohortgate-memory-") as tmp:
        server, port = spawn(
            Path(tmp) / "port",
            ["--metrics-listen", "off", "--history", "off", "--log-level", "warning"],
            stdout=open(Path(tmp) / "log", "wb"),  # noqa: SIM115 (closed with the process)
        )
        addr = f"127.0.0.1:{port}"
        try:
            time.sleep(1.0)
            before = rss_mib(server.pid)
            peak = before
            done = threading.Event()

            def sample() -> None:
                nonlocal peak
                while not done.is_set():
                    peak = max(peak, rss_mib(server.pid))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample)
            sampler.start()
            took, after = [], []
            for job in range(args.jobs):
                started = time.monotonic()
                results = run_job(addr, f"big-models-{job}", models)
                took.append(time.monotonic() - started)
                time.sleep(2.0)  # the verdict's fan-out done, uploads dropped
                after.append(rss_mib(server.pid))
            done.set()
            sampler.join()
        finally:
            server.terminate()
            server.wait(timeout=30)
    verdicts = {r.verdict.outcome for r in results if r.verdict is not None}
    uploads = sum(r.manifest_requests for r in results)
    row = {
        "ranks": args.ranks,
        "entries": args.entries,
        "uploads": uploads,
        "rss_before_mib": before,
        "rss_peak_mib": peak,
        "rss_after_each_job_mib": after,
        "growth_peak_mib": peak - before,
        "seconds_each_job": took,
        "outcomes": sorted(verdicts),
    }
    said = (
        f"{args.ranks} distinct {args.entries}-entry manifests ({uploads} uploads): coordinator "
        f"RSS {before:.0f} MiB before, peak {peak:.0f} MiB (+{peak - before:.0f}), "
        f"after each of {args.jobs} jobs {', '.join(f'{a:.0f}' for a in after)} MiB; "
        f"decided in {', '.join(f'{t:.1f}' for t in took)} s"
    )
    return save_figures(args.json, row, said)


if __name__ == "__main__":
    sys.exit(main())
