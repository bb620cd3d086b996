"""Run each mutant mutmut reported as survived again, directly, and say which really survive.

mutmut 3.8.1 reports some killed mutants as survived (their tests fail when run by hand).
This runs, inside `mutants/` (as `make mutation` leaves it), each survivor's mapped tests
(mutants/mutmut-stats.json) with the mutant switched on, after checking that the same tests
pass with no mutant: a survivor whose tests then fail was killed; one whose tests pass
survives. Prints one line per mutant and writes JSON (--json) for the closing note.

    python scripts/mutation_recheck.py                      # every survivor
    python scripts/mutation_recheck.py 'cohortgate.coordinator.edge.joins.*'
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

MUTANTS = Path("mutants")


def survivors(patterns: list[str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "results"], capture_output=True, text=True, check=True
    ).stdout
    names = [m.group(1) for m in re.finditer(r"^\s*(\S+): survived$", out, re.M)]
    return [n for n in names if not patterns or any(fnmatch.fnmatch(n, p) for p in patterns)]


def tests_of(name: str, stats: dict[str, list[str]]) -> list[str]:
    return sorted(stats.get(name.rpartition("__mutmut_")[0], []))


def run(tests: list[str], mutant: str, timeout: float) -> int:
    env = {**os.environ, "MUTANT_UNDER_TEST": mutant}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "no:randomly", "--timeout", "90", *tests]
    try:
        return subprocess.run(
            command, cwd=MUTANTS, env=env, capture_output=True, timeout=timeout
        ).returncode
    except subprocess.TimeoutExpired:
        return -1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="*", help="fnmatch patterns of mutant names")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    parser.add_argument("--json", type=Path, default=Path("mutation-recheck.json"))
    args = parser.parse_args()
    stats = json.loads((MUTANTS / "mutmut-stats.json").read_text())
    by_function = stats["tests_by_mangled_function_name"]
    names = survivors(args.patterns)
    print(f"{len(names)} mutant(s) reported as survived", flush=True)
    result: dict[str, str] = {}
    clean: dict[tuple[str, ...], int] = {}
    for name in names:
        tests = tests_of(name, by_function)
        if not tests:
            result[name] = "no tests"
        else:
            key = tuple(tests)
            if key not in clean:  # the tests pass with no mutant, or nothing is known
                clean[key] = run(tests, "", args.timeout)
            if clean[key] != 0:
                result[name] = "tests fail without a mutant"
            else:
                started = time.monotonic()
                code = run(tests, name, args.timeout)
                took = time.monotonic() - started
                result[name] = "survived" if code == 0 else "timeout" if code < 0 else "killed"
                result[name] += f" ({len(tests)} tests, {took:.0f} s)"
        print(f"{name}: {result[name]}", flush=True)
    args.json.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    verdicts = [r.split(" (")[0] for r in result.values()]
    print({v: verdicts.count(v) for v in sorted(set(verdicts))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
