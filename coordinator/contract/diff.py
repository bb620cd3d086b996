"""The difference between two manifests, as structure and as a readable report (torch-free)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.contract.manifest import Entry, Manifest

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

    def __bool__(self) -> bool:
        return self.first_difference is not None

    def __str__(self) -> str:
        return self.render()

    def render(self, cap: int = LIST_CAP) -> str:
        if not self:
            return "manifests are identical"
        lines = [self.first_difference.render() if self.first_difference else ""]
        lines.append(f"reference has {self.reference_size} entries, this one {self.other_size}")
        lines += _section("missing (in the reference, not here)", self.missing, cap, _entry)
        lines += _section("extra (here, not in the reference)", self.extra, cap, _entry)
        for attr, heading in _CHANGE_FIELDS:
            lines += _section(heading, getattr(self, attr), cap, _change)
        lines += _section("order changed", self.order_changed, cap, OrderChange.render)
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
        for attr, _ in _CHANGE_FIELDS:
            out[attr] = [c.to_dict() for c in getattr(self, attr)]
        return out


def _entry(entry: Entry) -> str:
    return entry.describe()


def _change(change: Change) -> str:
    ref, oth = change.reference, change.other
    return f"'{change.name}': {ref.describe(with_name=False)} -> {oth.describe(with_name=False)}"


def _section(heading: str, items: Sequence[Any], cap: int, show: Any) -> list[str]:
    if not items:
        return []
    lines = [f"{heading}: {len(items)}"]
    lines += [f"  {show(item)}" for item in items[:cap]]
    if len(items) > cap:
        lines.append(f"  and {len(items) - cap} more")
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


def diff(reference: Manifest, other: Manifest) -> ManifestDiff:
    """Compare `other` against `reference`: what is missing, extra, changed or reordered."""
    ref, oth = reference.entries, other.entries
    first = _first_difference(ref, oth)
    if first is None:
        return ManifestDiff(len(ref), len(oth))
    ref_by_name = {e.name: e for e in ref}
    oth_by_name = {e.name: e for e in oth}
    changes: dict[str, list[Change]] = {attr: [] for attr, _ in _CHANGE_FIELDS}
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
    return ManifestDiff(
        reference_size=len(ref),
        other_size=len(oth),
        first_difference=first,
        missing=tuple(e for e in ref if e.name not in oth_by_name),
        extra=tuple(e for e in oth if e.name not in ref_by_name),
        shape_changed=tuple(changes["shape_changed"]),
        dtype_changed=tuple(changes["dtype_changed"]),
        kind_changed=tuple(changes["kind_changed"]),
        requires_grad_changed=tuple(changes["requires_grad_changed"]),
        tying_changed=tuple(changes["tying_changed"]),
        strides_changed=tuple(changes["strides_changed"]),
        order_changed=tuple(_order_changes(ref, oth)),
    )
