"""A stall in words (decision/stall.py finds it): one line with the ranks grouped by where
they are, the smallest group first (the odd one out is the likely cause), and the full report
with each group's frames, the ranks that did not answer with their hosts, and the steps.
Identical for every rank. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from cohortgate.coordinator.contract import ranges
from cohortgate.coordinator.decision.words import plural

if TYPE_CHECKING:
    from cohortgate.coordinator.decision.stall import CohortProgress, Snapshot, Stall

# How long the ranks have to answer a snapshot request before the report goes out without
# the ones that did not.
SNAPSHOT_WAIT_S = 5.0
# Frames shown per group in the report.
SHOWN_FRAMES = 12
# Groups shown in full in the headline before the rest are counted.
HEADLINE_GROUPS = 4


def stall_words(p: CohortProgress, stall: Stall, now: float) -> tuple[str, str]:
    """The stall in one line (groups smallest first) and in full (each group's frames, the
    steps, what to do)."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for rank in sorted(stall.snapshots):
        s = stall.snapshots[rank]
        groups.setdefault((s.where, s.call, s.via), []).append(rank)
    ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
    silent = sorted(set(range(p.world_size)) - set(stall.snapshots))
    parts = [_group_text(ranks, stall.snapshots[ranks[0]], p.hosts) for _, ranks in ordered]
    if len(parts) > HEADLINE_GROUPS:
        rest = len(parts) - HEADLINE_GROUPS
        parts = [*parts[:HEADLINE_GROUPS], f"{plural(rest, 'more place')}"]
    if silent:
        parts.append(f"no answer from {_ranks_on(silent, p.hosts)}")
    head = f"stalled at step {stall.step} for {now - stall.since:.0f} s"
    headline = f"{head}: {'; '.join(parts)}"
    lines = [
        f"job '{p.job_id}' (cohort {p.cohort_id}): no rank reached a new step for "
        f"{now - stall.since:.0f} s (stall bound {p.bound() or 0:.0f} s)",
        "",
    ]
    for _, ranks in ordered:
        snap = stall.snapshots[ranks[0]]
        lines.append(f"{_group_text(ranks, snap, p.hosts)}:")
        lines.extend(f"    {f}" for f in snap.frames[:SHOWN_FRAMES])
        if len(snap.frames) > SHOWN_FRAMES:
            lines.append(f"    ... {plural(len(snap.frames) - SHOWN_FRAMES, 'more frame')}")
    if silent:
        lines.append(
            f"no answer from {_ranks_on(silent, p.hosts)} within {SNAPSHOT_WAIT_S:.0f} s "
            "(a stopped or dead process, or a lost host)"
        )
    by_step: dict[int, list[int]] = {}
    for rank, r in sorted(p.ranks.items()):
        by_step.setdefault(r.step, []).append(rank)
    steps = "; ".join(
        f"{_ranks_word(ranks)} at step {step} "
        f"({now - max(p.ranks[k].reached_at for k in ranks):.0f} s ago)"
        for step, ranks in sorted(by_step.items())
    )
    lines += ["", f"last steps: {steps}"]
    lines.append(
        "look first at the smallest group: the ranks that are somewhere the others are not"
    )
    return headline, "\n".join(lines)


def _group_text(ranks: list[int], snap: Snapshot, hosts: Mapping[int, str]) -> str:
    return f"{_ranks_on(ranks, hosts)} {snap.text()}"


def _ranks_on(ranks: list[int], hosts: Mapping[int, str]) -> str:
    on = sorted({hosts.get(r, "") for r in ranks} - {""})
    where = f" on {on[0]}" if len(on) == 1 else ""
    return f"{_ranks_word(ranks)}{where}"


def _ranks_word(ranks: list[int]) -> str:
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {ranges.compress_capped(ranks)}"
