"""The `code` check's local modules: ranks whose `modules` field differs (the local code files
they imported from their script's work tree, one combined digest) are asked, one rank per
class, for their files' digests, and the report names the files that differ.

The ask costs nothing when the ranks agree: only the one field is sent at join."""

from __future__ import annotations

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.decision.checks.base import Context
from cohortgate.coordinator.decision.cohort import CohortState, modules_key
from cohortgate.coordinator.decision.words import hosts as host_list

CLASSES_ASKED = 8  # code file lists asked for at most (the largest classes)
FILES_SHOWN = 8


def modules_classes(cohort: CohortState) -> list[tuple[bytes, list[int]]]:
    """(modules field, ranks) of every class of ranks that sent one, the largest first
    (ties: the class holding the lowest rank)."""
    by: dict[bytes, list[int]] = {}
    for rank in sorted(cohort.members):
        key = modules_key(cohort.members[rank])
        if key:
            by.setdefault(key, []).append(rank)
    return sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))


def wanted_files(ctx: Context) -> tuple[bytes, ...]:
    """The modules fields whose file lists are still to come, while worth waiting for."""
    classes = modules_classes(ctx.cohort)
    if len(classes) < 2 or ctx.now >= ctx.uploads_due:
        return ()
    return tuple(k for k, _ in classes[:CLASSES_ASKED] if k not in ctx.cohort.files)


def files_lines(cohort: CohortState) -> list[str]:
    """One line per class against the reference (the largest): the files that differ."""
    classes = modules_classes(cohort)
    if len(classes) < 2:
        return []
    ref_key, ref_ranks = classes[0]
    lines = []
    for key, ranks in classes[1:CLASSES_ASKED]:
        lines.append(
            f"code.modules: {_differ(cohort, ref_key, key)} on {_side(cohort, ranks)}, "
            f"against {_side(cohort, ref_ranks)}"
        )
    return lines


def _differ(cohort: CohortState, ref_key: bytes, key: bytes) -> str:
    ref, other = cohort.files.get(ref_key), cohort.files.get(key)
    if not ref or not other:
        return "files not named (their ranks did not send the list in time)"
    a, b = dict(ref), dict(other)
    differ = sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p))
    said = [f"{p}{_how(a, b, p)}" for p in differ[:FILES_SHOWN]]
    more = f" and {len(differ) - FILES_SHOWN} more" if len(differ) > FILES_SHOWN else ""
    word = "file differs" if len(differ) == 1 else "files differ"
    return f"{len(differ)} {word}: {', '.join(said)}{more}"


def _how(ref: dict[str, bytes], other: dict[str, bytes], path: str) -> str:
    if path not in ref:
        return " (imported only here)"
    if path not in other:
        return " (not imported here)"
    return ""


def _side(cohort: CohortState, ranks: list[int]) -> str:
    on = tuple(sorted({cohort.members[r].host for r in ranks}))
    word = "rank" if len(ranks) == 1 else "ranks"
    return f"{word} {ranges.compress_capped(ranks)} ({host_list(on)})"
