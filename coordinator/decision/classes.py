"""Signature, replica, weight and launch classes of a cohort: what the checks group by."""

from __future__ import annotations

from cohortgate.coordinator.decision.cohort import CohortState, Member
from cohortgate.coordinator.decision.verdict import LaunchGroup, SignatureClass


def launch_groups(cohort: CohortState) -> tuple[LaunchGroup, ...]:
    """Each known launch with its ranks, in the order of their lowest rank."""
    by: dict[str, list[Member]] = {}
    for m in [*cohort.members.values(), *cohort.intruders]:
        if m.launch:
            by.setdefault(m.launch, []).append(m)
    groups = [
        LaunchGroup(
            launch,
            tuple(sorted({m.rank for m in ms})),
            tuple(sorted({m.host for m in ms})),
        )
        for launch, ms in by.items()
    ]
    return tuple(sorted(groups, key=lambda g: (g.ranks[0], g.launch)))


def signature_classes(cohort: CohortState) -> tuple[SignatureClass, ...]:
    """Every class, reference first (the largest; ties go to the one holding the lowest rank),
    then the others in the order of their lowest rank."""
    return _classes(cohort, cohort.classes, "")


def _classes(
    cohort: CohortState, classes: dict[bytes, set[int]], group: str
) -> tuple[SignatureClass, ...]:
    built = []
    for signature, rank_set in classes.items():
        ranks = tuple(sorted(rank_set))
        hosts = tuple(sorted({cohort.members[r].host for r in ranks}))
        entries = cohort.members[ranks[0]].manifest_entries
        built.append(SignatureClass(signature, ranks, hosts, entries, group=group))
    built.sort(key=lambda c: (-len(c.ranks), c.ranks[0]))
    reference = built[0]
    others = sorted(built[1:], key=lambda c: c.ranks[0])
    return (
        SignatureClass(
            reference.signature,
            reference.ranks,
            reference.hosts,
            reference.manifest_entries,
            reference=True,
            group=group,
        ),
        *others,
    )


def replica_classes(cohort: CohortState) -> tuple[SignatureClass, ...]:
    """Under a layout: the signature classes of each replica group (ranks at one shard
    position, differing only in dp), for the groups holding more than one signature."""
    groups: dict[tuple[int, ...], dict[bytes, set[int]]] = {}
    labels: dict[tuple[int, ...], str] = {}
    for rank, m in cohort.members.items():
        assert m.layout is not None
        key = m.layout.replica_key
        labels[key] = m.layout.replica_label
        groups.setdefault(key, {}).setdefault(m.signature, set()).add(rank)
    out: list[SignatureClass] = []
    for key in sorted(groups, key=lambda k: min(r for s in groups[k].values() for r in s)):
        if len(groups[key]) > 1:
            out += _classes(cohort, groups[key], labels[key])
    return tuple(out)


def weight_classes(cohort: CohortState) -> dict[str, dict[bytes, list[int]]]:
    """Per replica group (its label; "" for all ranks when no layout is declared): weight
    digest -> ranks holding it, for ranks that sent one."""
    groups: dict[str, dict[bytes, list[int]]] = {}
    for rank in sorted(cohort.members):
        m = cohort.members[rank]
        if not m.weights_digest:
            continue
        label = m.layout.replica_label if m.layout is not None else ""
        groups.setdefault(label, {}).setdefault(m.weights_digest, []).append(rank)
    return groups
