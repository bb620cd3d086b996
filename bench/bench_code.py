"""What the `code` fingerprint costs at join, on every rank (issue 27 item 5): the script's
digest, git's commit and status, and the local modules it imported from its work tree
(`git ls-files`, then a SHA-256 of each tracked module's file).

A fresh git work tree holds a script and --modules local modules (--lines lines each) in
packages; a child process imports torch (so sys.modules is as large as a training job's),
the agent and every module, then times cohortgate.agent.identity.code_fields() --repeats times.

Usage: python bench/bench_code.py [--modules 20,200,1000] [--lines 300] [--repeats 20]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = """
import json, statistics, sys, time
sys.path[:0] = [{repo!r}, {tree!r}]
import torch
import cohortgate
from cohortgate import identity
for i in range({n}):
    __import__(f"pkg{{i // 50}}.mod{{i}}")
sys.modules["__main__"].__file__ = {script!r}
times = []
for _ in range({repeats}):
    t = time.perf_counter()
    fields = identity.code_fields()
    times.append(time.perf_counter() - t)
print(json.dumps({{"median_ms": 1e3 * statistics.median(times), "max_ms": 1e3 * max(times),
    "modules_field": fields.get("modules"), "sys_modules": len(sys.modules)}}))
"""


def tree_of(root: Path, n: int, lines: int) -> Path:
    for i in range(n):
        pkg = root / f"pkg{i // 50}"
        pkg.mkdir(exist_ok=True)
        (pkg / "__init__.py").touch()
        body = "".join(f"def f{j}(x):\n    return x + {j}\n" for j in range(lines // 2))
        (pkg / f"mod{i}.py").write_text(body)
    (root / "train.py").write_text("print('train')\n")
    git = ["git", "-C", str(root), "-c", "user.name=b", "-c", "user.email=b@b"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "bench"], check=True)
    return root


def measure(n: int, lines: int, repeats: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        tree = tree_of(Path(tmp), n, lines)
        code = CHILD.format(
            repo=str(REPO), tree=str(tree), n=n, script=str(tree / "train.py"), repeats=repeats
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
    said: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return {"modules": n, "lines": lines, **said}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--modules", default="20,200,1000", help="local modules (default 20,200,1000)")
    p.add_argument("--lines", type=int, default=300, help="lines per module (default 300)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls (default 20)")
    p.add_argument(
        "--json",
        type=Path,
        default=REPO / "bench" / "results" / "code.json",
        help="where the figures go (default: bench/results/code.json)",
    )
    args = p.parse_args()
    rows = [measure(int(n), args.lines, args.repeats) for n in args.modules.split(",")]
    print(f"code_fields() at join, median (max) of {args.repeats} calls, torch imported:")
    for r in rows:
        print(
            f"  {r['modules']:>5} local modules of {r['lines']} lines: {r['median_ms']:.1f} ms "
            f"({r['max_ms']:.1f}), {r['sys_modules']} modules in sys.modules, "
            f"field {r['modules_field']}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
