"""Coverage by corner parity against a brute-force count of every cell, on random layouts
(valid, overlapping, gapped, out of bounds, empty pieces; 1-D to 4-D)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cohortgate.coordinator.decision import coverage, parity
from tests.helpers import examples


def brute(
    shape: tuple[int, ...], pieces: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> np.ndarray:
    """How many pieces hold each cell (cells outside the tensor are not counted)."""
    held = np.zeros(shape, dtype=np.int64)
    for offset, length in pieces:
        box = tuple(slice(o, o + n) for o, n in zip(offset, length, strict=True))
        held[box] += 1
    return held


@st.composite
def layouts(
    draw: st.DrawFn,
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    dims = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(1, 4)) for _ in range(dims))
    if draw(st.booleans()):
        # a tiling (cut every dimension somewhere), then perhaps disturbed
        cuts = [sorted({0, s, *draw(st.lists(st.integers(0, s), max_size=3))}) for s in shape]
        pieces = [
            (tuple(c[0] for c in cell), tuple(c[1] - c[0] for c in cell))
            for cell in itertools.product(*(list(itertools.pairwise(c)) for c in cuts))
        ]
        action = draw(st.sampled_from(["none", "drop", "duplicate", "shift", "merge"]))
        if action == "drop" and pieces:
            pieces.pop(draw(st.integers(0, len(pieces) - 1)))
        elif action == "duplicate" and pieces:
            pieces.append(pieces[draw(st.integers(0, len(pieces) - 1))])
        elif action == "shift" and pieces:
            i = draw(st.integers(0, len(pieces) - 1))
            d = draw(st.integers(0, dims - 1))
            off = list(pieces[i][0])
            off[d] = max(
                0, min(off[d] + draw(st.sampled_from([-1, 1])), shape[d] - pieces[i][1][d])
            )
            pieces[i] = (tuple(off), pieces[i][1])
        elif action == "merge" and len(pieces) > 1:
            a, b = pieces[0], pieces[-1]
            lo = tuple(min(x, y) for x, y in zip(a[0], b[0], strict=True))
            hi = tuple(max(x + n, y + m) for x, n, y, m in zip(a[0], a[1], b[0], b[1], strict=True))
            pieces.append((lo, tuple(h - low for h, low in zip(hi, lo, strict=True))))
    else:
        box = st.tuples(*(st.integers(0, s) for s in shape))
        pieces = []
        for _ in range(draw(st.integers(0, 8))):
            lo, hi = draw(box), draw(box)
            pieces.append(
                (
                    tuple(min(a, b) for a, b in zip(lo, hi, strict=True)),
                    tuple(abs(a - b) for a, b in zip(lo, hi, strict=True)),
                )
            )
    return shape, pieces


def arrays(
    pieces: Sequence[tuple[tuple[int, ...], tuple[int, ...]]], dims: int
) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.array([p[0] for p in pieces], dtype=np.int64).reshape(-1, dims)
    lengths = np.array([p[1] for p in pieces], dtype=np.int64).reshape(-1, dims)
    return offsets, lengths


@settings(max_examples=examples(600), deadline=None)
@given(layouts())
def test_parity_says_tiles_exactly_when_every_cell_is_held_once(layout) -> None:  # type: ignore[no-untyped-def]
    shape, pieces = layout
    offsets, lengths = arrays(pieces, len(shape))
    assert parity.tiles(shape, offsets, lengths) == bool((brute(shape, pieces) == 1).all())


@settings(max_examples=examples(600), deadline=None)
@given(layouts())
def test_the_parity_path_names_real_problems_and_only_real_ones(layout) -> None:  # type: ignore[no-untyped-def]
    shape, pieces = layout
    pieces = [p for p in pieces if math.prod(p[1]) > 0]  # as check_arrays passes them
    offsets, lengths = arrays(pieces, len(shape))
    ranks = np.arange(len(pieces), dtype=np.int64)
    held = brute(shape, pieces)
    problems = coverage._check_parity("t", shape, ranks, offsets, lengths)
    assert (problems == []) == bool((held == 1).all()), problems
    for p in problems:
        if p.kind == "uncovered" and "is held by no rank" in p.detail:
            region = p.detail[1 : p.detail.index("]")]
            cell = tuple(int(span.split(":")[0]) for span in region.split(", "))
            spans = [tuple(map(int, span.split(":"))) for span in region.split(", ")]
            box = tuple(slice(a, b) for a, b in spans)
            assert (held[box] == 0).all(), (p.detail, cell)
        if p.kind == "overlap" and "held twice" in p.detail:
            region = p.detail[1 : p.detail.index("]")]
            box = tuple(slice(*map(int, span.split(":"))) for span in region.split(", "))
            assert (held[box] >= 2).all(), p.detail


@settings(max_examples=examples(300), deadline=None)
@given(layouts())
def test_the_coverage_check_agrees_with_the_brute_force_count(layout) -> None:  # type: ignore[no-untyped-def]
    shape, pieces = layout
    in_bounds = all(
        o >= 0 and o + n <= s for off, ln in pieces for o, n, s in zip(off, ln, shape, strict=True)
    )
    objects = [coverage.Piece(i, off, ln) for i, (off, ln) in enumerate(pieces)]
    tiled = in_bounds and bool((brute(shape, pieces) == 1).all()) and math.prod(shape) > 0
    assert (coverage.check("t", shape, objects) == []) == tiled


def huge(dims: int) -> int:
    """A scale that puts any shape's corner space (each size times it, plus one, multiplied
    out) at or past 2^62, with every coordinate still below 2^63: the row-sorting path."""
    exponent = {1: 60, 2: 31, 3: 21, 4: 16}[dims]
    return int(2**exponent)


# Not scaled down under `make mutation`: the only test that reaches the sorting paths (a
# corner space past the counting limit, and past 2^62), where a tensor of a real model's
# size goes; a few seconds.
@settings(max_examples=300, deadline=None)
@given(layouts(), st.sampled_from(["counting", "sorted", "rows"]))
def test_odd_corners_scale_with_the_layout_on_every_path(layout, path) -> None:  # type: ignore[no-untyped-def]
    """Corner parity is linear: the odd corners of a layout with every size times k are its
    odd corners times k, whichever way the keys are counted (a bincount of a small space,
    sorted int64 keys, or sorted rows of coordinates)."""
    shape, pieces = layout
    offsets, lengths = arrays(pieces, len(shape))
    k = {"counting": 1, "sorted": 5003, "rows": huge(len(shape))}[path]
    big = tuple(s * k for s in shape)
    want = parity.odd_corners(shape, offsets, lengths) * k
    got = parity.odd_corners(big, offsets * k, lengths * k)
    assert got.shape == want.shape and (got == want).all(), (got, want)
    in_bounds = all(
        o + n <= s for off, ln in pieces for o, n, s in zip(off, ln, shape, strict=True)
    )
    if in_bounds and all(math.prod(p[1]) > 0 for p in pieces):
        points = parity.mismatches(big, offsets * k, lengths * k)
        assert (points == parity.mismatches(shape, offsets, lengths) * k).all()
