"""torchrun's command line as `cohortgate run` needs it: its options, the script, the job id.

torch-free: the table of torchrun's options is kept here (a test checks it against torch's own
parser), so `cohortgate run` can reject a typo or a missing script before anything starts.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# torchrun's options that take no value (argparse nargs=0), by their canonical dest.
TORCHRUN_FLAGS: dict[str, tuple[str, ...]] = {
    "standalone": ("--standalone",),
    "module": ("-m", "--module"),
    "no_python": ("--no-python", "--no_python"),
    "run_path": ("--run-path", "--run_path"),
    "virtual_local_rank": ("--virtual-local-rank", "--virtual_local_rank"),
}


def _both(name: str) -> tuple[str, ...]:
    dashed = "--" + name.replace("_", "-")
    underscored = "--" + name
    return (dashed,) if dashed == underscored else (dashed, underscored)


# torchrun's options that take one value.
TORCHRUN_VALUES: dict[str, tuple[str, ...]] = {
    "nnodes": ("--nnodes",),
    "role": ("--role",),
    "redirects": ("-r", "--redirects"),
    "tee": ("-t", "--tee"),
    **{
        name: _both(name)
        for name in (
            "nproc_per_node",
            "rdzv_backend",
            "rdzv_endpoint",
            "rdzv_id",
            "rdzv_conf",
            "max_restarts",
            "monitor_interval",
            "start_method",
            "event_log_handler",
            "log_dir",
            "local_ranks_filter",
            "duplicate_stdout_filters",
            "duplicate_stderr_filters",
            "node_rank",
            "master_addr",
            "master_port",
            "local_addr",
            "logs_specs",
            "numa_binding",
            "signals_to_handle",
            "shutdown_timeout",
        )
    },
}

_BY_OPTION = {
    opt: dest
    for table in (TORCHRUN_FLAGS, TORCHRUN_VALUES)
    for dest, opts in table.items()
    for opt in opts
}


class LaunchError(ValueError):
    """The torchrun command line cannot work; the message says what to change."""


@dataclass
class TorchrunArgs:
    """torchrun's options by dest (flags as True), then the script and its arguments."""

    options: dict[str, str | bool] = field(default_factory=dict)
    script: str = ""
    script_args: list[str] = field(default_factory=list)

    def value(self, dest: str, environ: Mapping[str, str] | None = None) -> str | None:
        """An option's value as torchrun sees it: the flag, else its PET_<DEST> variable."""
        given = self.options.get(dest)
        if isinstance(given, str):
            return given
        env = os.environ if environ is None else environ
        return env.get("PET_" + dest.upper()) or None

    def flag(self, dest: str, environ: Mapping[str, str] | None = None) -> bool:
        env = os.environ if environ is None else environ
        raw = env.get("PET_" + dest.upper(), "")
        return bool(self.options.get(dest)) or raw.lower() in ("1", "true")

    def max_nodes(self, environ: Mapping[str, str] | None = None) -> int:
        """The most nodes `--nnodes` (N or MIN:MAX) allows; 1 when unset."""
        raw = self.value("nnodes", environ) or "1"
        top = raw.rpartition(":")[2]
        if not top.isdigit():
            raise LaunchError(f"--nnodes {raw!r} is not N or MIN:MAX")
        return int(top)


def _resolve(option: str) -> str:
    """An option's dest, accepting unique prefixes as torchrun's argparse does."""
    if option in _BY_OPTION:
        return _BY_OPTION[option]
    dests = {dest for opt, dest in _BY_OPTION.items() if opt.startswith(option)}
    if len(dests) == 1 and option.startswith("--") and len(option) > 2:
        return dests.pop()
    known = sorted(o for o in _BY_OPTION if o.startswith("--") and "_" not in o)
    hint = f" (did you mean {' or '.join(sorted(dests))}?)" if dests else ""
    raise LaunchError(f"{option} is not a torchrun option{hint}; torchrun takes {', '.join(known)}")


def parse_torchrun(argv: Sequence[str]) -> TorchrunArgs:
    """Split torchrun's argv into options, script and script arguments, as torchrun would."""
    out = TorchrunArgs()
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--":
            break
        if not arg.startswith("-") or arg == "-":
            args.insert(0, arg)
            break
        name, eq, inline = arg.partition("=")
        dest = _resolve(name)
        if dest in TORCHRUN_FLAGS:
            if eq:
                raise LaunchError(f"{name} takes no value (got {arg!r})")
            out.options[dest] = True
        elif eq:
            out.options[dest] = inline
        elif not args:
            raise LaunchError(f"{name} needs a value")
        else:
            out.options[dest] = args.pop(0)
    if not args:
        raise LaunchError("no training script given")
    out.script, out.script_args = args[0], args[1:]
    return out


def check_script(args: TorchrunArgs, cwd: Path | None = None) -> None:
    """A missing script fails now, not after a coordinator and N workers have started."""
    if args.flag("module") or args.flag("no_python"):
        return
    path = Path(args.script)
    if not path.is_absolute():
        path = (cwd or Path.cwd()) / path
    if not path.is_file():
        raise LaunchError(f"training script {args.script!r} does not exist (looked at {path})")


@dataclass(frozen=True)
class JobId:
    value: str
    generated: bool  # made up here: a single-node or --standalone launch with no id


def job_id(args: TorchrunArgs, environ: Mapping[str, str] | None = None) -> JobId:
    """The job id, exactly as a plain torchrun launch gives it to the agent: COHORTGATE_JOB,
    else --rdzv-id (TORCHELASTIC_RUN_ID in the workers). A random one only where no node
    has to agree on it: a --standalone or single-node launch without an id."""
    env = os.environ if environ is None else environ
    if env.get("COHORTGATE_JOB"):
        return JobId(env["COHORTGATE_JOB"], generated=False)
    given = args.value("rdzv_id", env)
    if given and given != "none" and not args.flag("standalone", env):
        return JobId(given, generated=False)
    if args.max_nodes(env) > 1 and not args.flag("standalone", env):
        raise LaunchError(
            "a multi-node launch (--nnodes "
            f"{args.value('nnodes', env)}) needs --rdzv-id JOB, the same on every node, so "
            "that every node's ranks join one cohort"
        )
    return JobId(f"run-{uuid.uuid4().hex[:12]}", generated=True)
