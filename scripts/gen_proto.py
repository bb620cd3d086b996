"""Generate the Python stubs from proto/ (or, with --check, fail if the committed ones differ).

The proto tree mirrors the import names: proto/cohortgate/coordinator/api/v1/cohort.proto generates
cohortgate.coordinator.api.v1.cohort_pb2 (the file coordinator/api/v1/cohort_pb2.py, the source
folder pyproject.toml maps to cohortgate.coordinator), so the generated imports resolve as written.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO = REPO / "proto"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(out: Path) -> list[Path]:
    protos = sorted(PROTO.rglob("*.proto"))
    if not protos:
        return []
    plugin = Path(sys.executable).parent / "protoc-gen-mypy"
    grpc_plugin = Path(sys.executable).parent / "protoc-gen-mypy_grpc"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={plugin}",
        f"--mypy_out={out}",
        f"--plugin=protoc-gen-mypy_grpc={grpc_plugin}",
        f"--mypy_grpc_out={out}",
        *[str(p.relative_to(PROTO)) for p in protos],
    ]
    subprocess.run(cmd, check=True, cwd=PROTO)
    # Generated under out/cohortgate/...: the repository folder of cohortgate.X is X/.
    return sorted(
        p.relative_to(out / "cohortgate") for p in out.rglob("*") if p.name.endswith(SUFFIXES)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        committed = sorted(
            p.relative_to(REPO)
            for p in (REPO / "coordinator").rglob("*")
            if p.name.endswith(SUFFIXES)
        )
        if args.check:
            stale = [f for f in files if not (REPO / f).exists()]
            stale += [
                f
                for f in files
                if (REPO / f).exists()
                and not filecmp.cmp(Path(tmp) / "cohortgate" / f, REPO / f, shallow=False)
            ]
            stale += [f for f in committed if f not in files]
            if stale:
                names = ", ".join(str(f) for f in stale)
                print(f"generated code does not match proto/: {names}; run `make proto`")
                return 1
            print(f"generated code matches proto/ ({len(files)} files)")
            return 0
        for f in committed:
            if f not in files:
                (REPO / f).unlink()
        for f in files:
            (REPO / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / "cohortgate" / f, REPO / f)
            print(f"wrote {f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
