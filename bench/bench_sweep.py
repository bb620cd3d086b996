"""What the watching timers cost the event loop per second (issue 40, item 4).

N formed cohorts of R ranks each (default 10,000 of 8) watched at once by the coordinator's
`Stalls` and `Audits` (in process, the in-memory history, the real metrics), every rank
marking a step and auditing it each second, as a healthy job does: the work of one second's
sweeps, (a) as the service does it now (the cohorts due, from `service/sweeper.Due`), and
(b) a sweep of every cohort, as the 1 s sweep did before (each cohort's own sweep called in
turn), on the same state in the same run. The per-call work (`beat`, `submit`) is the same
both ways and not counted.

Usage: python bench/bench_sweep.py [--cohorts 10000] [--ranks 8] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cohortgate.coordinator.decision.audit import RankAudit  # noqa: E402
from cohortgate.coordinator.decision.formation import FormationOptions  # noqa: E402
from cohortgate.coordinator.decision.stall import Beat  # noqa: E402
from cohortgate.coordinator.service.audits import Audits  # noqa: E402
from cohortgate.coordinator.service.observers import Observer  # noqa: E402
from cohortgate.coordinator.service.stalls import Stalls  # noqa: E402
from cohortgate.coordinator.state.backends import open_verdicts  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cohorts", type=int, default=10_000)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--seconds", type=int, default=20)
    asyncio.run(run(p.parse_args()))


async def run(a: argparse.Namespace) -> None:
    """On a loop (the timers are set on it), sweeping by hand: the loop never runs them."""
    clock, observer = Clock(), Observer()
    options = FormationOptions(stall_after_s=30.0)
    history = open_verdicts(None)
    stalls = Stalls(options, history, observer, clock)
    audits = Audits(options, history, observer, clock)
    due_s: list[float] = []
    all_s: list[float] = []
    for second in range(a.seconds):
        clock.now += 1.0
        for c in range(a.cohorts):
            cid = f"job{c}/1/x"
            stalls.beat(
                [Beat(cid, f"job{c}", 1, r, a.ranks, "h", f"i{r}", second) for r in range(a.ranks)]
            )
            digest = hashlib.sha256(str(second).encode()).digest()
            audits.submit(
                [
                    RankAudit(cid, f"job{c}", 1, r, a.ranks, "h", f"i{r}", second, digest)
                    for r in range(a.ranks)
                ]
            )
        t = time.perf_counter()
        stalls.sweep()
        audits.sweep()
        due_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for sc in stalls.cohorts.values():
            sc.sweep(clock.now)
        for ac in audits.cohorts.values():
            ac.sweep(clock.now, options.audit_timeout_s)
        stalls.watched.evict(clock.now, 600.0)
        audits.watched.evict(clock.now, 6 * 3600.0)
        all_s.append(time.perf_counter() - t)
    skip = min(2, a.seconds - 1)
    due_ms = statistics.median(due_s[skip:]) * 1e3
    all_ms = statistics.median(all_s[skip:]) * 1e3
    print(
        f"{a.cohorts} cohorts of {a.ranks} ranks, one step a second, median of "
        f"{a.seconds - skip} seconds: sweeps of the cohorts due {due_ms:.2f} ms a second; "
        f"a sweep of every cohort {all_ms:.2f} ms a second (x{all_ms / max(due_ms, 1e-6):.0f}); "
        f"due now: {len(stalls.due)} stall, {len(audits.due)} audit"
    )
    stalls.close()
    audits.close()


if __name__ == "__main__":
    main()
