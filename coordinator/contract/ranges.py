"""Rank sets as compressed ranges: [0,1,2,3,5,7,8] <-> "0-3,5,7-8"."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def compress(ranks: Iterable[int]) -> str:
    """Sorted, de-duplicated ranks as comma-separated runs; "" for none."""
    ordered = sorted(set(ranks))
    if not ordered:
        return ""
    runs = []
    start = prev = ordered[0]
    for r in ordered[1:]:
        if r == prev + 1:
            prev = r
            continue
        runs.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = r
    runs.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(runs)


def compress_capped(ranks: Iterable[int], max_runs: int = 20) -> str:
    """compress(), but past `max_runs` runs the rest is counted, not listed."""
    text = compress(ranks)
    runs = text.split(",")
    if len(runs) <= max_runs:
        return text
    return ",".join(runs[:max_runs]) + f" and {len(runs) - max_runs} more runs"


def expand(text: str) -> list[int]:
    """The inverse of compress(); raises ValueError naming the bad part."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad rank range {part!r}: expected N or N-M") from None
        if last < first:
            raise ValueError(f"bad rank range {part!r}: end before start")
        out.extend(range(first, last + 1))
    return out


def missing(present: Iterable[int], world_size: int) -> list[int]:
    """Ranks in [0, world_size) not in `present`."""
    have = set(present)
    return [r for r in range(world_size) if r not in have]


def missing_text(present: Iterable[int], world_size: int, max_runs: int = 20) -> str:
    """compress_capped(missing(present, world_size)) in O(present log present), not
    O(world_size): the gaps between present ranks are the missing runs. A 2^20-rank cohort
    with one rank joined costs one gap, not a million-element list."""
    runs: list[str] = []
    total = 0
    expected = 0
    for r in [*sorted(set(present)), world_size]:
        if r > expected:
            total += 1
            if len(runs) < max_runs:
                runs.append(f"{expected}-{r - 1}" if r - 1 > expected else str(expected))
        expected = r + 1
    text = ",".join(runs)
    return text if total <= max_runs else f"{text} and {total - max_runs} more runs"


def by_value(values: Mapping[int, str]) -> str:
    """'v1 on ranks 0-3, v2 on ranks 4-7': values grouped with their ranks."""
    groups: dict[str, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    ordered = sorted(groups.items(), key=lambda kv: min(kv[1]))
    return ", ".join(
        f"{v or '(none)'} on {_ranks_word(rs)} {compress_capped(rs, 8)}" for v, rs in ordered
    )


def _ranks_word(ranks: list[int]) -> str:
    return "rank" if len(ranks) == 1 else "ranks"
