"""How refusals are worded: host lists, class lines and the culprit headline, shared by every
check's words (checks/*) and the report that assembles them (report.py)."""

from __future__ import annotations

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.contract.diff import ManifestDiff
from cohortgate.coordinator.decision.cohort import CohortState
from cohortgate.coordinator.decision.verdict import Decision, DiffKey, SignatureClass

# A refused 4,096-node cohort must not print 4,096 host names per class.
HOST_CAP = 8

MODEL_ADVICE = (
    "every rank must build the same model (same code, config and dtype) and, when sharded, "
    "declare its true position and pieces. Fix the ranks named above and relaunch."
)


def hosts(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:HOST_CAP])
    return shown if len(names) <= HOST_CAP else f"{shown} and {len(names) - HOST_CAP} more"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def all_ranks(n: int) -> str:
    """ "all 4 ranks", "both ranks", "the one rank": never "all 2 ranks"."""
    return {1: "the one rank", 2: "both ranks"}.get(n, f"all {n} ranks")


def differ(n: int) -> str:
    """The verb for `n` things: "1 tensor of 6 differs", "2 tensors of 6 differ"."""
    return "differs" if n == 1 else "differ"


def _class_line(c: SignatureClass, label: str) -> str:
    return (
        f"{label} signature {c.signature.hex()[:12]}: {plural(len(c.ranks), 'rank')} "
        f"[{ranges.compress_capped(c.ranks)}] on {plural(len(c.hosts), 'host')} "
        f"{hosts(c.hosts)}, "
        f"{plural(c.manifest_entries, 'tensor')}"
    )


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def class_lines(
    classes: tuple[SignatureClass, ...], diffs: dict[DiffKey, ManifestDiff | None]
) -> list[str]:
    lines = []
    for c in classes:
        if c.reference:
            if c.group:
                lines.append(f"replica group {c.group} (ranks that must be identical):")
            lines.append(_class_line(c, "reference"))
            continue
        lines.append(_class_line(c, "differs:  "))
        d = diffs.get((c.group, c.signature))
        if d is None:
            lines.append("    (no manifest of this class reached the coordinator: no diff)")
        else:
            lines.append(_indent(d.render()))
    return lines


def refused(cohort: CohortState, head: str) -> str:
    """A report's first line."""
    return f"cohortgate refused to form job '{cohort.job_id}' round {cohort.round}: {head}"


def side(c: SignatureClass) -> str:
    ranks = ranges.compress_capped(c.ranks)
    return f"rank{'s' if len(c.ranks) > 1 else ''} {ranks} on {hosts(c.hosts)}"


def culprits_headline(decision: Decision) -> str | None:
    """The classes that differ from their reference, in one line; None when none do."""
    culprits = [c for c in decision.classes if not c.reference]
    if not culprits:
        return None
    refs = {c.group: c for c in decision.classes if c.reference}
    first = culprits[0]
    ref = refs.get(first.group)
    group = f" in replica group {first.group}" if first.group else ""
    more = f" (and {plural(len(culprits) - 1, 'more class')})" if len(culprits) > 1 else ""
    if ref is not None and len(ref.ranks) <= max(len(c.ranks) for c in culprits):
        # A tie for the most ranks: the reference is only the one holding the lowest
        # rank, so no side is named as the one that differs.
        return (
            f"no majority{group}: {side(ref)} and {side(first)} built different models"
            f"{more}; compare them to find which one is wrong"
        )
    against = f" ranks {ranges.compress_capped(ref.ranks)}" if ref else " the others"
    return f"{side(first)} built a different model than{against}{group}{more}"
