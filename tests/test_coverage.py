"""Shard coverage on boxes and flat ranges: in bounds, disjoint, and adding up to the whole."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import pytest

from cohortgate.coordinator.decision import coverage
from cohortgate.coordinator.decision.coverage import (
    CoverageProblem,
    Piece,
    check,
    check_arrays,
    check_columns,
    check_flat,
)


def kinds(problems: list) -> list[str]:  # type: ignore[type-arg]
    return [p.kind for p in problems]


def test_column_parallel_split_tiles() -> None:
    pieces = [Piece(r, (r * 8, 0), (8, 16)) for r in range(4)]
    assert check("fc1.weight", (32, 16), pieces) == []


def test_two_dimensional_grid_tiles() -> None:
    pieces = [Piece(2 * i + j, (i * 5, j * 3), (5, 3)) for i in range(2) for j in range(2)]
    assert check("w", (10, 6), pieces) == []


def test_seed_counterexample_counts_match_but_two_pieces_write_one_place() -> None:
    # Two 2-element pieces both write [0:2] of a 4-element shard; [2:4] is never written.
    problems = check_flat("shard", 4, [(0, 0, 2), (1, 0, 2)])
    assert kinds(problems) == ["overlap", "uncovered"]
    assert {p.tensor for p in problems} == {"shard"}
    assert problems[0].ranks == (0, 1)
    assert "[0:2] is held twice" in problems[0].detail
    assert "[2:4] is held by no rank" in problems[1].detail


def test_overlap_names_the_range_and_the_ranks() -> None:
    pieces = [Piece(0, (0, 0), (20, 16)), Piece(1, (16, 0), (16, 16))]
    (problem,) = check("layers.0.fc1.weight", (32, 16), pieces)
    assert problem.kind == "overlap"
    assert "[16:20, 0:16] is held twice" in problem.detail
    assert problem.ranks == (0, 1)


def test_gap_names_the_uncovered_range() -> None:
    pieces = [Piece(0, (0, 0), (8, 16)), Piece(1, (12, 0), (20, 16))]
    assert check("w", (32, 16), pieces) == [
        CoverageProblem(
            "w",
            "uncovered",
            "[8:12, 0:16] is held by no rank (neighbouring pieces on ranks 0,1)",
            (0, 1),
        )
    ]


def test_tail_never_written_is_uncovered() -> None:
    (problem,) = check_flat("flat", 10, [(0, 0, 4), (1, 4, 4)])
    assert problem.kind == "uncovered"
    assert "[8:10]" in problem.detail


def test_out_of_bounds_and_wrong_rank_of_shape() -> None:
    assert kinds(check("w", (8,), [Piece(0, (4,), (8,))])) == ["out_of_bounds"]
    assert kinds(check("w", (8,), [Piece(0, (-1,), (4,))])) == ["out_of_bounds"]
    assert kinds(check("w", (8, 2), [Piece(0, (0,), (8,))])) == ["shape"]


def test_identical_pieces_are_an_overlap() -> None:
    assert kinds(check("b", (4,), [Piece(0, (0,), (4,)), Piece(1, (0,), (4,))])) == ["overlap"]


def test_staggered_bricks_fall_back_to_pairwise_and_pass() -> None:
    # Not a grid: rows split at different columns.
    pieces = [
        Piece(0, (0, 0), (1, 3)),
        Piece(1, (0, 3), (1, 1)),
        Piece(2, (1, 0), (1, 1)),
        Piece(3, (1, 1), (1, 3)),
    ]
    assert check("bricks", (2, 4), pieces) == []
    overlapping = [*pieces[:3], Piece(3, (0, 2), (2, 2))]
    assert "overlap" in kinds(check("bricks", (2, 4), overlapping))


def bricks(rows: int, columns: int, shift: int | None = None) -> list[Piece]:
    """A brick wall over (rows, columns): even rows in bricks of 2 from 0, odd rows from 1
    (half-bricks at their ends), so no grid of slabs tiles it; `shift` moves that row's
    second brick one column right."""
    pieces: list[Piece] = []
    for r in range(rows):
        starts = list(range(0, columns, 2)) if r % 2 == 0 else [0, *range(1, columns, 2)]
        for k, s in enumerate(starts):
            width = min(1 if r % 2 and s == 0 else 2, columns - s)
            offset = s + 1 if r == shift and k == 1 else s
            pieces.append(Piece(len(pieces) % 8, (r, offset), (1, width)))
    return pieces


def test_a_large_irregular_layout_is_checked_by_corner_parity() -> None:
    assert len(bricks(20, 40)) > 256
    assert check("wall", (20, 40), bricks(20, 40)) == []
    shifted = check("wall", (20, 40), bricks(20, 40, shift=3))
    assert kinds(shifted) == ["overlap", "uncovered"], shifted
    assert "[3:4, 3:4] is held twice" in shifted[0].detail, shifted[0].detail
    assert "[3:4, 1:2] is held by no rank" in shifted[1].detail, shifted[1].detail
    gapped = bricks(20, 40)
    gapped.pop(100)
    assert kinds(check("wall", (20, 40), gapped)) == ["uncovered"]
    doubled = [*bricks(20, 40), bricks(20, 40)[7]]
    assert kinds(check("wall", (20, 40), doubled)) == ["overlap"]


def test_million_flat_pieces_tile() -> None:
    ranges = [(i % 64, i * 3, 3) for i in range(200_000)]
    assert check_flat("big", 600_000, ranges) == []


def test_a_large_grid_names_its_overlap_and_its_gap() -> None:
    grid = [Piece(i % 8, (i // 20 * 2, i % 20 * 3), (2, 3)) for i in range(400)]  # 20 x 20
    assert check("grid", (40, 60), grid) == []
    doubled = check("grid", (40, 60), [*grid, grid[37]])
    assert kinds(doubled) == ["overlap"] and "[2:4, 51:54] is held twice" in doubled[0].detail
    holed = check("grid", (40, 60), grid[:37] + grid[38:])
    assert kinds(holed) == ["uncovered"] and "[2:4, 51:54] is held by no rank" in holed[0].detail


Int64s = npt.NDArray[np.int64]


def as_columns(pieces: list[Piece], dims: int) -> tuple[Int64s, Int64s, Int64s]:
    """Pieces as the columns the fast paths take: ranks (n,), offsets and lengths (n, dims)."""
    return (
        np.array([p.rank for p in pieces], dtype=np.int64),
        np.array([p.offset for p in pieces], dtype=np.int64).reshape(len(pieces), dims),
        np.array([p.length for p in pieces], dtype=np.int64).reshape(len(pieces), dims),
    )


def columns(shape: tuple[int, ...], pieces: list[Piece]) -> list[CoverageProblem]:
    """check_arrays (the columns' path, which check() takes from FAST_MIN_PIECES pieces)."""
    return check_arrays("t", shape, *as_columns(pieces, len(shape))) or []


def test_off_the_grid_pieces_name_their_tensor_the_overlap_and_the_gap() -> None:
    bricks = [Piece(0, (0, 0), (1, 3)), Piece(1, (0, 3), (1, 1)), Piece(2, (1, 0), (1, 1))]
    assert columns((2, 4), [*bricks, Piece(3, (1, 1), (1, 3))]) == []
    assert columns((2, 4), [*bricks, Piece(3, (0, 2), (2, 2))]) == [
        CoverageProblem(
            "t",
            "overlap",
            "[0:1, 2:3] is held twice: by [0:1, 0:3] on rank 0 and by [0:2, 2:4] on rank 3",
            (0, 3),
        ),
        CoverageProblem(
            "t",
            "uncovered",
            "[1:2, 1:2] is held by no rank (neighbouring pieces on ranks 0,2)",
            (0, 2),
        ),
    ]


@pytest.mark.parametrize(
    ("shape", "held"),
    [
        ((4,), "12"),
        ((2**31, 2**30), "more than 2^62"),  # 1.5 * 2^62 elements: past the exact count
        # 2^80 elements a piece: the product wraps in int64; such pieces are not empty
        ((2**40, 2**40), "more than 2^62"),
    ],
)
def test_every_element_held_three_times_is_an_overlap_told_by_count(
    shape: tuple[int, ...], held: str
) -> None:
    """Held an odd number of times everywhere, the corner parity is a tiling's: the count
    of elements tells (two whole copies and two halves)."""
    half = (shape[0] // 2, *shape[1:])
    zeros = (0,) * len(shape)
    pieces = [
        Piece(0, zeros, shape),
        Piece(1, zeros, shape),
        Piece(2, zeros, half),
        Piece(3, (half[0], *zeros[1:]), half),
    ]
    total = math.prod(shape)
    assert columns(shape, pieces) == [
        CoverageProblem(
            "t",
            "overlap",
            f"the pieces hold {held} elements of the tensor's {total}: some are held three "
            "times or more",
            (0, 1, 2, 3),
        )
    ]


def test_the_parity_path_alone_names_no_pieces_and_whole_copies() -> None:
    """decision.coverage._check_parity takes any in-bounds layout (check_arrays hands it
    only those off the grid): none at all, one whole piece, two."""

    def parity(pieces: list[Piece]) -> list[CoverageProblem]:
        return coverage._check_parity("t", (2, 3), *as_columns(pieces, 2))

    whole = [Piece(4, (0, 0), (2, 3)), Piece(7, (0, 0), (2, 3))]
    assert parity([]) == [CoverageProblem("t", "uncovered", "[0:2, 0:3] is held by no rank", ())]
    assert parity(whole[:1]) == []
    assert parity(whole) == [
        CoverageProblem(
            "t",
            "overlap",
            "[0:2, 0:3] is held twice: by [0:2, 0:3] on rank 4 and by [0:2, 0:3] on rank 7",
            (4, 7),
        )
    ]


def test_pieces_outside_the_tensor_are_named_twenty_then_counted() -> None:
    def outside(n: int) -> list[CoverageProblem]:
        return check_columns(
            "w", (8,), *as_columns([Piece(r, (8 + r,), (1,)) for r in range(n)], 1)
        )

    twenty = outside(20)
    assert [(p.tensor, p.kind, p.ranks) for p in twenty] == [
        ("w", "out_of_bounds", (r,)) for r in range(20)
    ]
    assert twenty[3].detail == "piece [11:12] on rank 3 lies outside the tensor's shape [8]"
    more = outside(37)
    assert more[:20] == twenty
    assert more[20:] == [
        CoverageProblem("w", "out_of_bounds", "17 more pieces lie outside it", tuple(range(20, 36)))
    ]


def test_a_negative_offset_or_length_is_outside_the_tensor() -> None:
    def one(offset: int, length: int) -> list[CoverageProblem]:
        return check_columns("w", (8,), *as_columns([Piece(5, (offset,), (length,))], 1))

    assert [p.kind for p in one(-1, 4)] == ["out_of_bounds"]
    assert [p.kind for p in one(2, -1)] == ["out_of_bounds"]


def test_many_pieces_take_the_columns_path_and_name_their_tensor() -> None:
    n = 256  # FAST_MIN_PIECES: from here check_arrays
    ranks = np.arange(n, dtype=np.int64)
    offsets = ranks.reshape(n, 1).copy()
    offsets[-1] = n - 2  # the last piece on its neighbour's element: an overlap and a gap
    lengths = np.ones((n, 1), dtype=np.int64)
    assert check_columns("big", (n,), ranks, offsets, lengths) == [
        CoverageProblem(
            "big",
            "overlap",
            "[254:255] is held twice: by [254:255] on rank 254 and by [254:255] on rank 255",
            (254, 255),
        ),
        CoverageProblem(  # named by its neighbours, as the other paths name a gap
            "big",
            "uncovered",
            "[255:256] is held by no rank (neighbouring pieces on ranks 254,255)",
            (254, 255),
        ),
    ]


def test_a_missing_cell_of_a_grid_is_named_by_the_pieces_beside_it() -> None:
    grid = [Piece(10 * i + j, (i, 2 * j), (1, 2)) for i in range(3) for j in range(3)]
    gone = [p for p in grid if p.rank != 11]  # the middle cell: four neighbours
    assert columns((3, 6), gone) == [
        CoverageProblem(
            "t",
            "uncovered",
            "[1:2, 2:4] is held by no rank (neighbouring pieces on ranks 1,10,12,21)",
            (1, 10, 12, 21),
        )
    ]
    corner = [p for p in grid if p.rank != 22]  # a corner: two
    assert columns((3, 6), corner)[0].ranks == (12, 21)


def row_of(n: int, length: int = 1) -> list[Piece]:
    """n pieces of `length` side by side, rank i at i * length: at FAST_MIN_PIECES and
    beyond, check() takes the columns' path."""
    return [Piece(i, (i * length,), (length,)) for i in range(n)]


def test_the_columns_path_hands_pieces_outside_the_tensor_to_the_path_that_names_them() -> None:
    for bad in (Piece(300, (-1,), (1,)), Piece(300, (5,), (-1,)), Piece(300, (256,), (1,))):
        problems = check("w", (256,), [*row_of(256), bad])
        assert [(p.tensor, p.kind, p.ranks) for p in problems] == [("w", "out_of_bounds", (300,))]
    wrong_dims = check("w", (256, 1), row_of(256))  # pieces of one dimension, a tensor of two
    assert {(p.kind, len(p.ranks)) for p in wrong_dims} == {("shape", 1)}


def test_empty_pieces_among_many_change_nothing() -> None:
    empties = [Piece(400 + i, (i,), (0,)) for i in range(10)]
    assert check("w", (256,), [*row_of(256), *empties]) == []
    gap = check("w", (256,), [*row_of(255), *empties])
    assert [(p.tensor, p.kind, p.detail) for p in gap] == [
        ("w", "uncovered", "[255:256] is held by no rank (neighbouring pieces on ranks 254)")
    ]


def test_many_pieces_off_the_grid_name_their_tensor() -> None:
    """Pieces of 2 from 0, and one of 2 from 1 over two of them: not a grid (it spans two
    cells), so corner parity names the overlap."""
    problems = check("w", (512,), [*row_of(256, 2), Piece(999, (1,), (2,))])
    assert [(p.tensor, p.kind, p.ranks) for p in problems] == [("w", "overlap", (0, 999))]


def test_the_piece_by_piece_path_at_its_edges() -> None:
    """Few pieces (check() without the columns): a piece whose offset has the wrong
    dimensions, empty pieces, a gap at the very start, all pieces empty, and the
    cap on what one tensor reports (21 problems)."""
    half = [Piece(0, (0, 0), (2, 2)), Piece(1, (2, 0), (2, 2))]
    assert [(p.kind, p.ranks) for p in check("w", (4, 2), [*half, Piece(7, (0,), (1,))])] == [
        ("shape", (7,))
    ]
    assert check("w", (4, 2), [*half, Piece(7, (1, 1), (0, 0))]) == []  # empty: not outside
    assert check("w", (4,), [Piece(3, (1,), (3,))]) == [
        CoverageProblem(
            "w", "uncovered", "[0:1] is held by no rank (neighbouring pieces on ranks 3)", (3,)
        )
    ]
    assert check("w", (4,), [Piece(3, (1,), (0,))]) == [
        CoverageProblem("w", "uncovered", "the pieces hold 0 of 4 elements", ())
    ]
    sparse = [Piece(i, (2 * i,), (1,)) for i in range(30)]  # a gap after every piece
    assert len(check("w", (60,), sparse)) == 21
