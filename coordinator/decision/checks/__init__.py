"""The layered identity checks: global fingerprint, placement, replica classes, coverage and
runtime, each under its own policy (strict refuses, warn forms and records, off ignores)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from coordinator.contract import ranges
from coordinator.contract.layout import AXES, Layout
from coordinator.decision import coverage


class Member(Protocol):
    runtime: dict[str, str]


STRICT, WARN, OFF = "strict", "warn", "off"
LEVELS = (STRICT, WARN, OFF)
DEFAULT_POLICY: dict[str, str] = {
    "model": STRICT,
    "layout": STRICT,
    "coverage": STRICT,
    "runtime.device_type": STRICT,
    "runtime.nccl": STRICT,
    "runtime.torch": WARN,
    "runtime.cuda": WARN,
    "runtime.device_name": WARN,
    "runtime.device_capability": WARN,
    # Off unless configured: the digest costs each rank a pass over its weights.
    "weights": OFF,
}


@dataclass(frozen=True)
class Policies:
    """Levels per check; `jobs` overrides them per job id."""

    default: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_POLICY))
    jobs: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def for_job(self, job_id: str) -> dict[str, str]:
        levels = dict(DEFAULT_POLICY)
        levels.update(self.default)
        levels.update(self.jobs.get(job_id, {}))
        return levels

    @classmethod
    def parse(cls, defaults: Iterable[str] = (), per_job: Iterable[str] = ()) -> Policies:
        """`check=level` items; per job `JOB:check=level`. ValueError says what is wrong."""

        def item(text: str) -> tuple[str, str]:
            check, sep, level = text.partition("=")
            check, level = check.strip(), level.strip()
            if not sep or check not in DEFAULT_POLICY or level not in LEVELS:
                raise ValueError(
                    f"policy {text!r}: expected CHECK=LEVEL with CHECK one of "
                    f"{', '.join(DEFAULT_POLICY)} and LEVEL one of {', '.join(LEVELS)}"
                )
            return check, level

        base = dict(item(t) for t in defaults)
        jobs: dict[str, dict[str, str]] = {}
        for text in per_job:
            job, sep, rest = text.rpartition(":")
            if not sep or not job:
                raise ValueError(f"job policy {text!r}: expected JOB:CHECK=LEVEL")
            jobs.setdefault(job, {}).update([item(rest)])
        return cls(base, jobs)


@dataclass(frozen=True)
class Finding:
    check: str
    level: str
    text: str
    ranks: tuple[int, ...] = ()


def _by_value(values: Mapping[int, str]) -> str:
    groups: dict[str, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    ordered = sorted(groups.items(), key=lambda kv: min(kv[1]))
    return ", ".join(
        f"{v or '(none)'} on ranks {ranges.compress_capped(rs, 8)}" for v, rs in ordered
    )


def _disagreement(name: str, values: Mapping[int, str]) -> str | None:
    return None if len(set(values.values())) <= 1 else f"{name}: {_by_value(values)}"


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2]) if version else ""


RUNTIME_FIELDS: dict[str, tuple[str, Callable[[str], str]]] = {
    "runtime.device_type": ("device_type", str),
    "runtime.nccl": ("nccl_version", _major_minor),
    "runtime.torch": ("torch_version", str),
    "runtime.cuda": ("cuda_version", str),
    "runtime.device_name": ("device_name", str),
    "runtime.device_capability": ("device_capability", str),
}


def runtime_findings(members: Mapping[int, Member], levels: Mapping[str, str]) -> list[Finding]:
    out = []
    for check, (key, normal) in RUNTIME_FIELDS.items():
        if levels.get(check, OFF) == OFF:
            continue
        text = _disagreement(key, {r: normal(m.runtime.get(key, "")) for r, m in members.items()})
        if text is not None:
            out.append(Finding(check, levels[check], text, tuple(sorted(members))))
    return out


def layout_findings(
    members: Mapping[int, Member],
    layouts: Mapping[int, Layout],
    world_size: int,
    levels: Mapping[str, str],
) -> list[Finding]:
    """Global fingerprint and placement ('layout', 'model') and shard coverage ('coverage')."""
    out: list[Finding] = []
    missing = sorted(set(members) - set(layouts))
    if missing:
        return [
            Finding(
                "layout",
                levels["layout"],
                f"ranks {ranges.compress_capped(missing)} declared no layout while ranks "
                f"{ranges.compress_capped(sorted(layouts))} did: every rank must declare one",
                tuple(missing),
            )
        ]
    fields: dict[str, tuple[str, Callable[[Layout], str]]] = {
        "format": ("layout", lambda lay: str(lay.format)),
        "model_config": ("model", lambda lay: lay.config),
        "dtype": ("model", lambda lay: lay.dtype),
        "quantization": ("model", lambda lay: lay.quantization),
        **{f"{a}_size": ("layout", _size_of(a)) for a in AXES},
    }
    global_ok = True
    for name, (check, get) in fields.items():
        text = _disagreement(name, {r: get(lay) for r, lay in layouts.items()})
        if text is not None and levels[check] != OFF:
            out.append(Finding(check, levels[check], text, tuple(sorted(layouts))))
            global_ok = global_ok and check != "layout"
    if not global_ok or levels["layout"] == OFF:
        return out
    sample = next(iter(layouts.values()))
    sizes = {a: sample.size(a) for a in AXES}
    mesh = math.prod(sizes.values())
    if mesh != world_size:
        out.append(
            Finding(
                "layout",
                levels["layout"],
                f"the mesh {' x '.join(f'{a}={s}' for a, s in sizes.items() if s > 1) or '1'} "
                f"has {mesh} positions but the world size is {world_size}",
                tuple(sorted(layouts)),
            )
        )
        return out
    holders: dict[tuple[int, ...], list[int]] = {}
    for rank, lay in layouts.items():
        bad = [a for a in AXES if not 0 <= lay.position.get(a, 0) < sizes[a]]
        if bad:
            out.append(
                Finding(
                    "layout",
                    levels["layout"],
                    f"rank {rank} declares position {_pos(lay.position)}, outside the mesh "
                    f"({', '.join(f'{a} < {sizes[a]}' for a in bad)})",
                    (rank,),
                )
            )
        holders.setdefault(lay.position_key, []).append(rank)
    for key, ranks in sorted(holders.items(), key=lambda kv: min(kv[1])):
        if len(ranks) > 1:
            out.append(
                Finding(
                    "layout",
                    levels["layout"],
                    f"position {_pos(dict(zip(AXES, key, strict=True)))} is held by ranks "
                    f"{ranges.compress(ranks)}: every position must be held exactly once",
                    tuple(sorted(ranks)),
                )
            )
    if any(f.check == "layout" and f.level != OFF for f in out):
        return out  # coverage by placement first: with positions wrong, replicas are too
    if levels["coverage"] != OFF:
        out += coverage_findings(layouts, sizes["dp"], levels["coverage"])
    return out


def _size_of(axis: str) -> Callable[[Layout], str]:
    return lambda lay: str(lay.size(axis))


def _pos(position: Mapping[str, int]) -> str:
    return " ".join(f"{a}={position.get(a, 0)}" for a in AXES)


def coverage_findings(layouts: Mapping[int, Layout], dp: int, level: str) -> list[Finding]:
    """Within each replica (one dp index), every logical tensor's pieces must tile it; and
    every replica must hold the same logical tensors."""
    out: list[Finding] = []
    names = {
        replica: {
            p.tensor
            for lay in layouts.values()
            if lay.position.get("dp", 0) == replica
            for p in lay.pieces
        }
        for replica in range(dp)
    }
    everything = set().union(*names.values()) if names else set()
    for replica, tensor_names in names.items():
        absent = sorted(everything - tensor_names)
        if absent:
            ranks = tuple(r for r, lay in layouts.items() if lay.position.get("dp", 0) == replica)
            shown = ", ".join(f"'{t}'" for t in absent[:10])
            more = f" and {len(absent) - 10} more" if len(absent) > 10 else ""
            out.append(
                Finding(
                    "coverage",
                    level,
                    f"replica dp={replica} declares no piece of {shown}{more}, which other "
                    "replicas hold",
                    ranks,
                )
            )
    for replica in range(dp):
        members = {r: lay for r, lay in layouts.items() if lay.position.get("dp", 0) == replica}
        tensors: dict[str, list[tuple[int, coverage.Piece, tuple[int, ...], bool]]] = {}
        for rank, lay in members.items():
            for p in lay.pieces:
                tensors.setdefault(p.tensor, []).append(
                    (rank, coverage.Piece(rank, p.offset, p.length), p.shape, p.replicated)
                )
        for tensor, held in sorted(tensors.items()):
            shapes = {r: str(list(shape)) for r, _, shape, _ in held}
            text = _disagreement(f"'{tensor}' logical shape", shapes)
            if text is not None:
                out.append(
                    Finding("coverage", level, f"replica dp={replica}: {text}", tuple(shapes))
                )
                continue
            shape = held[0][2]
            copies = {(p.offset, p.length) for _, p, _, rep in held if rep}
            if len(copies) > 1:
                boxes = {r: p.describe().split(" on ")[0] for r, p, _, rep in held if rep}
                out.append(
                    Finding(
                        "coverage",
                        level,
                        f"replica dp={replica}: '{tensor}' replicated pieces disagree: "
                        f"{_by_value(boxes)}",
                        tuple(boxes),
                    )
                )
                continue
            pieces = [p for _, p, _, rep in held if not rep]
            replicated = [p for _, p, _, rep in held if rep]
            if replicated:
                pieces.append(replicated[0])  # one copy counts; the others agree with it
            for problem in coverage.check(tensor, shape, pieces):
                out.append(
                    Finding(
                        "coverage",
                        level,
                        f"replica dp={replica}: {problem.render()}",
                        problem.ranks,
                    )
                )
    return out
