"""Where the main thread is, read from another thread (the agent's background thread runs
while the main thread waits inside a collective: torch releases the GIL there).

A snapshot names the innermost frame of user code (the script, or an installed trainer such
as transformers or lightning; not torch, numpy, grpc, the standard library or cohortgate),
the library call below it (the innermost public
function: `all_reduce`, `backward`) and the outermost library frame it went through
(`DistributedDataParallel.forward`), so that ranks waiting in the same collective from the same
line read the same, and a rank stuck in its own code reads as that code.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType

MAX_FRAMES = 32  # the coordinator's limit (edge.rpc.MAX_SNAPSHOT_FRAMES)
MAX_TEXT = 500
# Library frames that only pass a call on: never named as the call.
_WRAPPERS = frozenset(
    {"_call_impl", "_wrapped_call_impl", "wrapper", "inner", "_fn", "decorate_context"}
)


@dataclass(frozen=True)
class Where:
    where: str
    call: str
    via: str
    frames: tuple[str, ...]


# Installed packages whose frames are plumbing, not a program's: a call into them is named
# as the call. Any other installed package (transformers, lightning, a team's trainer) reads
# as the program's code: its frame is where the rank is.
RUNTIME_PACKAGES = ("torch", "numpy", "grpc", "google.protobuf")


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    installed = tuple(paths[k] for k in ("purelib", "platlib") if k in paths)
    # the standard library's directories, but never one that holds the installed packages
    # (a venv's platstdlib is its lib/pythonX.Y, above its site-packages)
    dirs = {
        d
        for d in (
            os.path.dirname(os.__file__),
            paths.get("stdlib", ""),
            paths.get("platstdlib", ""),
        )
        if d and not any(i.startswith(d.rstrip(os.sep) + os.sep) for i in installed)
    }
    dirs.add(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # cohortgate
    for name in RUNTIME_PACKAGES:
        found = getattr(sys.modules.get(name), "__file__", None)
        if found:
            dirs.add(os.path.dirname(os.path.abspath(found)))
    return tuple(sorted(d.rstrip(os.sep) + os.sep for d in dirs if d))


def is_library(filename: str, libraries: Sequence[str]) -> bool:
    if filename.startswith("<"):  # <frozen importlib._bootstrap>; <string> is `python -c`'s
        return filename.startswith("<frozen")
    return os.path.abspath(filename).startswith(tuple(libraries))


def _name(frame: FrameType) -> str:
    code = frame.f_code
    return getattr(code, "co_qualname", code.co_name)


def _line(frame: FrameType) -> str:
    code = frame.f_code
    return f"{_short(code.co_filename)}:{frame.f_lineno} in {_name(frame)}"[:MAX_TEXT]


def _short(filename: str) -> str:
    """A path as a person reads it: from site-packages (torch/...), else the file's name
    relative to the working directory when under it."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        at = filename.rfind(marker)
        if at >= 0:
            return filename[at + len(marker) :]
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


def where(frame: FrameType | None, libraries: Sequence[str] | None = None) -> Where:
    """The snapshot of a stack, given its innermost frame."""
    libs = _library_dirs() if libraries is None else libraries
    stack: list[FrameType] = []
    while frame is not None and len(stack) < 256:
        stack.append(frame)
        frame = frame.f_back
    library = [is_library(f.f_code.co_filename, libs) for f in stack]
    frames = tuple(_line(f) for f in stack[:MAX_FRAMES])
    user = next((i for i, lib in enumerate(library) if not lib), None)
    if user is None:  # nothing of the script's (a thread of a library's): the innermost frame
        top = stack[0] if stack else None
        return Where(_line(top) if top else "(no frames)", "", "", frames)
    u = stack[user]
    here = f"{_name(u)} ({_short(u.f_code.co_filename)}:{u.f_lineno})"[:MAX_TEXT]
    below = [f for f in stack[:user] if _name(f).rsplit(".", 1)[-1] not in _WRAPPERS]
    if not below:
        return Where(here, "", "", frames)
    public = [f for f in below if not _name(f).rsplit(".", 1)[-1].startswith("_")]
    call = _name((public or below)[0])[:MAX_TEXT]
    via = _name(below[-1])[:MAX_TEXT]
    return Where(here, call, "" if via == call else via, frames)


def main_thread() -> Where:
    """Where the main thread is now (from any other thread)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    return where(frame)
