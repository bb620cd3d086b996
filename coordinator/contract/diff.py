"""The difference between two manifests, as structure and as a readable report (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cohortgate.coordinator.contract.manifest import Entry, ManifestLike

# Lists in the rendering stop here; a 4,096-layer model need not print 4,096 lines.
LIST_CAP = 20


@dataclass(frozen=True)
class FirstDifference:
    """The first position at which the two manifests disagree, entry by entry."""

    position: int
    reference: Entry | None
    other: Entry | None

    def render(self) -> str:
        ref, oth = self.reference, self.other
        if ref is not None and oth is not None and ref.name == oth.name:
            detail = (
                f"'{ref.name}' {ref.describe(with_name=False)} vs {oth.describe(with_name=False)}"
            )
        else:
            left = ref.describe() if ref is not None else "<end of manifest>"
            right = oth.describe() if oth is not None else "<end of manifest>"
            detail = f"{left} vs {right}"
        return f"first difference at position {self.position}: {detail}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "reference": None if self.reference is None else self.reference.to_dict(),
            "other": None if self.other is None else self.other.to_dict(),
        }


@dataclass(frozen=True)
class Change:
    """One entry present in both manifests whose `field` differs."""

    name: str
    reference: Entry
    other: Entry

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "reference": self.reference.to_dict(),
            "other": self.other.to_dict(),
        }


@dataclass(frozen=True)
class OrderChange:
    """The same entries in another order: the first displaced position, per namespace."""

    kind: str
    position: int
    reference_name: str
    other_name: str

    def render(self) -> str:
        return (
            f"{self.kind}s in another order: at {self.kind} position {self.position} the "
            f"reference has '{self.reference_name}', this one '{self.other_name}'"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "position": self.position,
            "reference_name": self.reference_name,
            "other_name": self.other_name,
        }


# (attribute of ManifestDiff, heading in the rendering)
_CHANGE_FIELDS = (
    ("shape_changed", "shape changed"),
    ("dtype_changed", "dtype changed"),
    ("kind_changed", "kind changed (parameter vs buffer)"),
    ("requires_grad_changed", "requires_grad changed"),
    ("tying_changed", "tying changed"),
    ("strides_changed", "memory layout (strides) changed"),
)
CHANGE_FIELDS = tuple(attr for attr, _ in _CHANGE_FIELDS)
# Every list a diff holds, in report order: the wire's `counts` keys, the stored record's.
CATEGORIES = ("missing", "extra", *CHANGE_FIELDS, "order_changed")


@dataclass(frozen=True)
class ManifestDiff:
    """Everything that sets `other` apart from `reference`; falsy when they are equal."""

    reference_size: int
    other_size: int
    first_difference: FirstDifference | None = None
    missing: tuple[Entry, ...] = ()
    extra: tuple[Entry, ...] = ()
    shape_changed: tuple[Change, ...] = ()
    dtype_changed: tuple[Change, ...] = ()
    kind_changed: tuple[Change, ...] = ()
    requires_grad_changed: tuple[Change, ...] = ()
    tying_changed: tuple[Change, ...] = ()
    strides_changed: tuple[Change, ...] = ()
    order_changed: tuple[OrderChange, ...] = ()
    # Per category, how many items the full diff had, where the lists above were capped
    # (a stored verdict keeps LIST_CAP of each); None: the lists are whole.
    totals: dict[str, int] | None = field(default=None, compare=False)

    def count(self, category: str) -> int:
        if self.totals is not None:
            return self.totals[category]
        return len(getattr(self, category))

    def capped(self, cap: int = LIST_CAP) -> ManifestDiff:
        """The same diff holding at most `cap` items per list; counts and rendering unchanged."""
        lists = {c: getattr(self, c)[:cap] for c in CATEGORIES}
        return replace(self, **lists, totals={c: self.count(c) for c in CATEGORIES})

    def __bool__(self) -> bool:
        return self.first_difference is not None

    def __str__(self) -> str:
        return self.render()

    def render(self, cap: int = LIST_CAP) -> str:
        if not self:
            return "manifests are identical"
        lines = [self.first_difference.render() if self.first_difference else ""]
        lines.append(f"reference has {self.reference_size} entries, this one {self.other_size}")
        sections = [
            ("missing", "missing (in the reference, not here)", _entry),
            ("extra", "extra (here, not in the reference)", _entry),
            *((attr, heading, _change) for attr, heading in _CHANGE_FIELDS),
            ("order_changed", "order changed", OrderChange.render),
        ]
        for attr, heading, show in sections:
            lines += _section(heading, getattr(self, attr), self.count(attr), cap, show)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "reference_size": self.reference_size,
            "other_size": self.other_size,
            "first_difference": (
                None if self.first_difference is None else self.first_difference.to_dict()
            ),
            "missing": [e.to_dict() for e in self.missing],
            "extra": [e.to_dict() for e in self.extra],
            "order_changed": [o.to_dict() for o in self.order_changed],
        }
        for attr in CHANGE_FIELDS:
            out[attr] = [c.to_dict() for c in getattr(self, attr)]
        if self.totals is not None:
            out["totals"] = dict(self.totals)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ManifestDiff:
        """The inverse of `to_dict` (a stored verdict's diff)."""

        def entry(d: dict[str, Any] | None) -> Entry | None:
            return None if d is None else Entry.from_dict(d)

        def change(d: dict[str, Any]) -> Change:
            return Change(d["name"], Entry.from_dict(d["reference"]), Entry.from_dict(d["other"]))

        first = data["first_difference"]
        changed: dict[str, Any] = {
            attr: tuple(change(c) for c in data[attr]) for attr in CHANGE_FIELDS
        }
        return cls(
            reference_size=data["reference_size"],
            other_size=data["other_size"],
            first_difference=None
            if first is None
            else FirstDifference(
                first["position"], entry(first["reference"]), entry(first["other"])
            ),
            missing=tuple(Entry.from_dict(e) for e in data["missing"]),
            extra=tuple(Entry.from_dict(e) for e in data["extra"]),
            order_changed=tuple(OrderChange(**o) for o in data["order_changed"]),
            totals=data.get("totals"),
            **changed,
        )


def _entry(entry: Entry) -> str:
    return entry.describe()


def _change(change: Change) -> str:
    ref, oth = change.reference, change.other
    return f"'{change.name}': {ref.describe(with_name=False)} -> {oth.describe(with_name=False)}"


def _section(heading: str, items: Sequence[Any], total: int, cap: int, show: Any) -> list[str]:
    if not total:
        return []
    lines = [f"{heading}: {total}"]
    lines += [f"  {show(item)}" for item in items[:cap]]
    if total > cap:
        lines.append(f"  and {total - cap} more")
    return lines


def _first_difference(ref: Sequence[Entry], oth: Sequence[Entry]) -> FirstDifference | None:
    for position, (a, b) in enumerate(zip(ref, oth, strict=False)):
        if a != b:
            return FirstDifference(position, a, b)
    if len(ref) != len(oth):
        position = min(len(ref), len(oth))
        return FirstDifference(
            position,
            ref[position] if position < len(ref) else None,
            oth[position] if position < len(oth) else None,
        )
    return None


def _order_changes(ref: Sequence[Entry], oth: Sequence[Entry]) -> list[OrderChange]:
    """Within each namespace, compare the order of the names both sides hold there."""
    out = []
    for kind in ("parameter", "buffer"):
        ref_names = {e.name for e in ref if e.kind == kind}
        oth_names = {e.name for e in oth if e.kind == kind}
        common = ref_names & oth_names
        ref_order = [e.name for e in ref if e.name in common and e.kind == kind]
        oth_order = [e.name for e in oth if e.name in common and e.kind == kind]
        for position, (a, b) in enumerate(zip(ref_order, oth_order, strict=True)):
            if a != b:
                out.append(OrderChange(kind, position, a, b))
                break
    return out


def diff(reference: ManifestLike, other: ManifestLike) -> ManifestDiff:
    """Compare `other` against `reference`: what is missing, extra, changed or reordered."""
    ref, oth = reference.entries, other.entries
    first = _first_difference(ref, oth)
    if first is None:
        return ManifestDiff(len(ref), len(oth))
    ref_by_name = {e.name: e for e in ref}
    oth_by_name = {e.name: e for e in oth}
    changes: dict[str, list[Change]] = {attr: [] for attr in CHANGE_FIELDS}
    for a in ref:
        b = oth_by_name.get(a.name)
        if b is None or a == b:
            continue
        for attr, differs in (
            ("shape_changed", a.shape != b.shape),
            ("dtype_changed", a.dtype != b.dtype),
            ("kind_changed", a.kind != b.kind),
            ("requires_grad_changed", a.kind == b.kind and a.requires_grad != b.requires_grad),
            ("tying_changed", a.alias_of != b.alias_of),
            ("strides_changed", a.strides != b.strides),
        ):
            if differs:
                changes[attr].append(Change(a.name, a, b))
    changed: dict[str, Any] = {attr: tuple(found) for attr, found in changes.items()}
    return ManifestDiff(
        reference_size=len(ref),
        other_size=len(oth),
        first_difference=first,
        missing=tuple(e for e in ref if e.name not in oth_by_name),
        extra=tuple(e for e in oth if e.name not in ref_by_name),
        order_changed=tuple(_order_changes(ref, oth)),
        **changed,
    )
