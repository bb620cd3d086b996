"""A cohort's pieces as columns (decision.pieces): every tensor of every rank checked at
once, against a brute-force count of every cell. (The wire's columns and their validation:
test_layout_wire.py.)"""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.contract.layout import Layout, PieceColumns, ShardPiece, layout
from cohortgate.coordinator.decision.checks.coverage import DETAILED, CoverageCheck
from cohortgate.coordinator.decision.coverage import OUTSIDE_NAMED
from cohortgate.coordinator.decision.pieces import CONFLICTS_NAMED, LARGE, CohortPieces
from cohortgate.coordinator.decision.verdict import Level
from tests.helpers import examples
from tests.test_parity import brute
from tests.test_parity import layouts as tensor_layouts

Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


def findings(layouts: dict[int, Layout], dp: int = 1, large: int | None = None) -> list[str]:
    check = CoverageCheck()
    table = CohortPieces(layouts, large)
    return [
        f.text for f in check._shapes(table, Level.STRICT) + check._tiling(table, dp, Level.STRICT)
    ]


def named(texts: list[str]) -> set[str]:
    return {name for text in texts for name in re.findall(r"'(t\d+)'", text)}


@st.composite
def cohorts(draw: st.DrawFn) -> tuple[dict[int, Layout], dict[str, bool]]:
    """Up to 5 tensors (1-D to 4-D, and scalars), each tiled or disturbed, their pieces dealt
    to up to 4 ranks; some tensors held whole by every rank as replicated copies (one copy
    perhaps another box). Returns the layouts and, per tensor, whether it tiles."""
    ranks = draw(st.integers(1, 4))
    held: dict[int, list[ShardPiece]] = {r: [] for r in range(ranks)}
    tiles = {}
    for t in range(draw(st.integers(1, 5))):
        name = f"t{t}"
        kind = draw(st.sampled_from(["boxes", "boxes", "boxes", "replicated", "scalar"]))
        if kind == "scalar":
            count = draw(st.integers(0, 2))
            for _ in range(count):
                held[draw(st.integers(0, ranks - 1))].append(ShardPiece(name, (), (), ()))
            if count:
                tiles[name] = count == 1
            continue
        shape, boxes = draw(tensor_layouts())
        if kind == "replicated":
            wrong = draw(st.booleans()) and ranks > 1 and shape[0] > 1
            for r in range(ranks):
                length = (shape[0] - 1, *shape[1:]) if wrong and r == ranks - 1 else shape
                held[r].append(ShardPiece(name, shape, (0,) * len(shape), length, True))
            tiles[name] = not wrong
            continue
        if draw(st.booleans()) and boxes:  # one piece past the tensor's end
            i = draw(st.integers(0, len(boxes) - 1))
            offset, length = boxes[i]
            boxes[i] = (offset, (length[0] + 1, *length[1:]))
        if not boxes:
            continue
        for offset, length in boxes:
            held[draw(st.integers(0, ranks - 1))].append(ShardPiece(name, shape, offset, length))
        in_bounds = all(
            o + n <= s for off, ln in boxes for o, n, s in zip(off, ln, shape, strict=True)
        )
        tiles[name] = in_bounds and bool((brute(shape, boxes) == 1).all())
    layouts = {
        r: Layout({"tp": ranks}, {"tp": r}, pieces=tuple(pieces)) for r, pieces in held.items()
    }
    return layouts, tiles


@pytest.mark.slow
@settings(max_examples=examples(400), deadline=None)
@given(cohorts())
def test_every_tensor_at_once_agrees_with_the_brute_force_count(cohort) -> None:  # type: ignore[no-untyped-def]
    layouts, tiles = cohort
    broken = {name for name, ok in tiles.items() if not ok}
    assert named(findings(layouts)) == broken
    table = CohortPieces(layouts)
    large, failing = table.examine(0)
    assert not large
    flagged = {table.names[t] for t in failing}
    # The columns settle every tensor that tiles with pieces of some volume; only the rest
    # are looked at one by one.
    empty = {
        p.tensor
        for lay in layouts.values()
        for p in lay.pieces
        if not p.replicated and 0 in p.length
    }
    assert broken <= flagged <= broken | empty
    # Every tensor checked alone, as a large one is: the same verdicts.
    assert named(findings(layouts, large=1)) == broken


def scaled(layouts: dict[int, Layout], k: int) -> dict[int, Layout]:
    """Every shape, offset and length times `k`: each tensor tiles exactly as before."""

    def times(values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(v * k for v in values)

    return {
        r: dataclasses.replace(
            lay,
            pieces=tuple(
                ShardPiece(p.tensor, times(p.shape), times(p.offset), times(p.length), p.replicated)
                for p in lay.pieces
            ),
        )
        for r, lay in layouts.items()
    }


# Not scaled down under `make mutation` (a few seconds): this is the test that tells a fast
# path that waves a broken tensor through from one that does not, and 20 examples miss it.
@settings(max_examples=300, deadline=None)
@given(cohorts(), st.sampled_from([1, 5003]))
def test_the_columns_flag_every_tensor_that_does_not_tile_and_no_grid_that_does(  # type: ignore[no-untyped-def]
    cohort, k
) -> None:
    """The columnar pass alone (no one-by-one check after it), small cut spaces (a prefix
    count) and large ones (k = 5003: sorted cuts and binary search): every tensor that does
    not tile is flagged, and nothing else except tensors with an empty piece."""
    layouts, tiles = cohort
    broken = {name for name, ok in tiles.items() if not ok}
    table = CohortPieces(scaled(layouts, k))
    large, failing = table.examine(0)
    assert not large
    flagged = {table.names[t] for t in failing}
    empty = {
        p.tensor
        for lay in layouts.values()
        for p in lay.pieces
        if not p.replicated and 0 in p.length
    }
    assert broken <= flagged <= broken | empty, (broken, flagged)


def test_a_large_tensor_is_checked_alone_and_its_problems_named() -> None:
    side = 72  # 72 x 72 = 5,184 pieces (>= LARGE) of a 2-D grid, dealt to 3 ranks
    assert side * side >= LARGE
    cells = [(i, j) for i in range(side) for j in range(side)]
    pieces = {
        r: [ShardPiece("t0", (side * 2, side), (2 * i, j), (2, 1)) for i, j in cells[r::3]]
        for r in range(3)
    }
    layouts = {r: Layout({"tp": 3}, {"tp": r}, pieces=tuple(p)) for r, p in pieces.items()}
    table = CohortPieces(layouts)
    large, failing = table.examine(0)
    assert list(large) == [0] and failing == []
    assert findings(layouts) == []
    row, column = pieces[1][7].offset
    pieces[1][7] = pieces[1][7]._replace(offset=(row + 1, column))  # one row down
    layouts[1] = Layout({"tp": 3}, {"tp": 1}, pieces=tuple(pieces[1]))
    texts = findings(layouts)
    assert [t.split(": ")[2] for t in texts] == ["overlap", "uncovered"], texts


def tp_layouts(tensors: int, tp: int, rows: int = 64) -> dict[int, Layout]:
    """Rank r of a tp-way split: even tensors split by rows, odd ones by columns, a bias
    replicated; sent through the wire as agents send them (columns)."""
    out = {}
    for r in range(tp):
        decl = layout(r, tp=tp)
        for i in range(tensors):
            decl.split(f"t{i}", (rows, rows), i % 2, r, tp)
        decl.replicated("bias", (rows,))
        out[r] = wire.layout_from_pb(wire.layout_to_pb(decl.build()))
        assert isinstance(out[r].pieces, PieceColumns)
    return out


def moved(lay: Layout, tensor: str, shift: tuple[int, ...] | None) -> Layout:
    """`lay` with the piece of `tensor` moved by `shift` (or dropped: None)."""
    pieces = []
    for p in lay.pieces:
        if p.tensor != tensor:
            pieces.append(p)
        elif shift is not None:
            pieces.append(
                p._replace(offset=tuple(o + s for o, s in zip(p.offset, shift, strict=True)))
            )
    return Layout(lay.sizes, lay.position, pieces=tuple(pieces))


def test_thousands_of_small_tensors_are_settled_together_and_the_broken_ones_named() -> None:
    layouts = tp_layouts(2000, 8)
    assert findings(layouts) == []
    layouts[3] = moved(layouts[3], "t10", (1, 0))  # row-split: overlaps rank 4's piece
    layouts[5] = moved(layouts[5], "t11", None)  # column-split: columns 40:48 held by nobody
    texts = findings(layouts)
    assert named(texts) == {"t10", "t11"}, texts
    assert any("'t10': overlap: [32:33, 0:64] is held twice" in t for t in texts), texts
    assert any("'t11': uncovered" in t and "[0:64, 40:48]" in t for t in texts), texts


def test_past_the_detailed_limit_the_rest_are_counted() -> None:
    layouts = tp_layouts(DETAILED + 10, 2)
    for i in range(DETAILED + 10):
        layouts[1] = moved(layouts[1], f"t{i}", None)
    texts = findings(layouts)
    assert sum("uncovered" in t for t in texts) == DETAILED
    assert any("10 more tensors do not tile" in t for t in texts), texts[-1]


def test_ranks_that_disagree_on_a_tensors_shape_are_named() -> None:
    layouts = tp_layouts(4, 4)
    wide = layout(2, tp=4).split("t1", (64, 128), 1, 2, 4)
    for i in (0, 2, 3):
        wide.split(f"t{i}", (64, 64), i % 2, 2, 4)
    layouts[2] = Layout(layouts[2].sizes, layouts[2].position, pieces=wide.build().pieces)
    texts = findings(layouts)
    assert texts == ["'t1' logical shape: [64, 64] on ranks 0-1,3, [64, 128] on rank 2"], texts


def test_out_of_bounds_pieces_are_named_up_to_a_limit_then_counted() -> None:
    pieces = tuple(ShardPiece("t0", (64,), (i,), (1,)) for i in range(64)) + tuple(
        ShardPiece("t0", (64,), (64 + i,), (1,)) for i in range(OUTSIDE_NAMED + 10)
    )
    texts = findings({0: Layout({}, {}, pieces=pieces)})
    assert sum("lies outside the tensor's shape [64]" in t for t in texts) == OUTSIDE_NAMED
    assert texts[-1].endswith("'t0': out of bounds: 10 more pieces lie outside it"), texts[-1]


def test_shape_conflicts_past_a_limit_are_counted_not_walked() -> None:
    """A rank giving every one of many tensors another shape: the first are named with every
    rank's shape, the rest counted (naming each would walk every table per tensor)."""
    many = CONFLICTS_NAMED + 30
    layouts = tp_layouts(many, 2)
    wide = layout(1, tp=2)
    for i in range(many):
        wide.split(f"t{i}", (64, 128), 1, 1, 2)
    wide.replicated("bias", (64,))
    layouts[1] = Layout(layouts[1].sizes, layouts[1].position, pieces=wide.build().pieces)
    texts = findings(layouts)
    assert sum("logical shape: [64, 64] on rank 0, [64, 128] on rank 1" in t for t in texts) == (
        CONFLICTS_NAMED
    ), texts
    assert texts[CONFLICTS_NAMED] == "ranks disagree on the logical shapes of 30 more tensors"
    assert len(texts) == CONFLICTS_NAMED + 1, texts[CONFLICTS_NAMED + 1 :]
    # the first by name (t0, t1, t10, ...), not the first declared (t0, t1, t2, ...)
    first = sorted(f"t{i}" for i in range(many))[:CONFLICTS_NAMED]
    assert named(texts) == set(first), texts


def test_conflicts_and_broken_tensors_are_named_in_name_order_whatever_order_ranks_declare() -> (
    None
):
    """Declared 'z' first then 'a' (ids follow declaration): the report goes by name. A
    scalar on one rank and a vector on another is a conflict too (the first rank's tensor
    has 0 dimensions)."""
    scalar_first = {
        0: Layout({"tp": 2}, {"tp": 0}, pieces=(ShardPiece("s", (), (), ()),)),
        1: Layout({"tp": 2}, {"tp": 1}, pieces=(ShardPiece("s", (4,), (0,), (4,)),)),
    }
    assert findings(scalar_first) == ["'s' logical shape: [] on rank 0, [4] on rank 1"]

    conflicts = {
        0: Layout(
            {"tp": 2},
            {"tp": 0},
            pieces=(ShardPiece("z", (4,), (0,), (2,)), ShardPiece("a", (4,), (0,), (2,))),
        ),
        1: Layout(
            {"tp": 2},
            {"tp": 1},
            pieces=(ShardPiece("z", (6,), (2,), (2,)), ShardPiece("a", (6,), (2,), (2,))),
        ),
    }
    texts = findings(conflicts)
    assert [t.split("'")[1] for t in texts] == ["a", "z"], texts
    gaps = {  # both tiled with a gap: 'z' then 'a' as declared, named 'a' then 'z'
        0: Layout(
            {"tp": 2},
            {"tp": 0},
            pieces=(ShardPiece("z", (4,), (0,), (1,)), ShardPiece("a", (4,), (0,), (1,))),
        ),
        1: Layout(
            {"tp": 2},
            {"tp": 1},
            pieces=(ShardPiece("z", (4,), (2,), (2,)), ShardPiece("a", (4,), (2,), (2,))),
        ),
    }
    table = CohortPieces(gaps)
    _, failing = table.examine(0)
    assert [table.names[t] for t in failing] == ["a", "z"]
