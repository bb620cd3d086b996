"""Shard coverage: the pieces of a logical tensor are in bounds, disjoint and add up to it.

In bounds + pairwise disjoint + volumes summing to the whole proves the pieces tile the
tensor, so no separate hole check is needed (coverage by placement, not by count). From
FAST_MIN_PIECES pieces on, columns of numbers, no per-piece Python: a grid layout (every
TP/PP/FSDP split) as distinct cells of the grid its boundaries cut; any other layout by
corner parity (decision.parity), both O(pieces log pieces). Fewer pieces walk slabs along
each dimension, pairwise where slabs overlap.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cohortgate.coordinator.decision import parity


@dataclass(frozen=True)
class Piece:
    """The part of a logical tensor one rank holds: a box (offset and length per dimension)."""

    rank: int
    offset: tuple[int, ...]
    length: tuple[int, ...]

    @property
    def volume(self) -> int:
        return math.prod(self.length)

    def describe(self) -> str:
        spans = ", ".join(f"{o}:{o + n}" for o, n in zip(self.offset, self.length, strict=True))
        return f"[{spans}] on rank {self.rank}"


@dataclass(frozen=True)
class CoverageProblem:
    tensor: str
    kind: str  # out_of_bounds | overlap | uncovered | shape | unverifiable
    detail: str
    ranks: tuple[int, ...]

    def render(self) -> str:
        return f"'{self.tensor}': {self.kind.replace('_', ' ')}: {self.detail}"


def check(tensor: str, shape: Sequence[int], pieces: Sequence[Piece]) -> list[CoverageProblem]:
    """Every problem with how `pieces` cover a tensor of `shape` (empty when they tile it)."""
    if len(pieces) >= FAST_MIN_PIECES and all(len(p.offset) == len(shape) for p in pieces):
        ranks = np.fromiter((p.rank for p in pieces), dtype=np.int64, count=len(pieces))
        offsets = np.array([p.offset for p in pieces], dtype=np.int64).reshape(len(pieces), -1)
        lengths = np.array([p.length for p in pieces], dtype=np.int64).reshape(len(pieces), -1)
        fast = check_arrays(tensor, shape, ranks, offsets, lengths)
        if fast is not None:
            return fast
    return _check_pieces(tensor, shape, pieces)


# Below this many pieces the plain Python path is as fast and needs no arrays.
FAST_MIN_PIECES = 256
Int64s = npt.NDArray[np.int64]
# Out-of-bounds pieces named one by one; the rest are counted.
OUTSIDE_NAMED = 20


def check_columns(
    tensor: str, shape: Sequence[int], ranks: Int64s, offsets: Int64s, lengths: Int64s
) -> list[CoverageProblem]:
    """check() for pieces as columns (ranks (n,), offsets and lengths (n, dims)), with no
    object per piece unless there are few: what the coverage check calls for a tensor that
    does not plainly tile."""
    shape_arr = np.asarray(tuple(shape), dtype=np.int64)
    outside = np.flatnonzero(
        ((offsets < 0) | (lengths < 0) | (offsets + lengths > shape_arr)).any(axis=1)
    )
    if len(outside):
        problems = [
            CoverageProblem(
                tensor,
                "out_of_bounds",
                f"piece {_piece_at(ranks, offsets, lengths, int(i)).describe()} lies outside "
                f"the tensor's shape {list(shape)}",
                (int(ranks[i]),),
            )
            for i in outside[:OUTSIDE_NAMED]
        ]
        if len(outside) > OUTSIDE_NAMED:
            problems.append(
                CoverageProblem(
                    tensor,
                    "out_of_bounds",
                    f"{len(outside) - OUTSIDE_NAMED} more pieces lie outside it",
                    tuple(sorted({int(r) for r in ranks[outside[OUTSIDE_NAMED:]][:16]})),
                )
            )
        return problems
    if len(ranks) >= FAST_MIN_PIECES:
        fast = check_arrays(tensor, shape, ranks, offsets, lengths)
        if fast is not None:
            return fast
    return _check_pieces(
        tensor,
        shape,
        [
            Piece(r, tuple(o), tuple(n))
            for r, o, n in zip(ranks.tolist(), offsets.tolist(), lengths.tolist(), strict=True)
        ],
    )


def check_arrays(
    tensor: str, shape: Sequence[int], ranks: Int64s, offsets: Int64s, lengths: Int64s
) -> list[CoverageProblem] | None:
    """The grid fast path, vectorised: pieces as columns (ranks (n,), offsets and lengths
    (n, dims)). Cut every dimension at every piece boundary; when each piece is exactly one
    cell of that grid, the pieces tile the tensor iff their cells are distinct and as many as
    the cells; any other layout goes by corner parity. Returns None when a piece is out of
    bounds (the caller names it)."""
    n, dims = offsets.shape
    shape_arr = np.asarray(tuple(shape), dtype=np.int64)
    ends = offsets + lengths
    if dims != len(shape) or bool(
        (offsets < 0).any() or (lengths < 0).any() or (ends > shape_arr).any()
    ):
        return None  # the slow path names the offending pieces
    live = (lengths > 0).all(axis=1)  # not the product's sign: past 2^63 it wraps
    if not live.all():
        ranks, offsets, lengths, ends = ranks[live], offsets[live], lengths[live], ends[live]
        n = len(ranks)
    cells_per_dim = []
    index = np.zeros(n, dtype=np.int64)
    for d in range(dims):
        cuts = _cuts(offsets[:, d], ends[:, d], shape[d])
        lo = np.searchsorted(cuts, offsets[:, d])
        hi = np.searchsorted(cuts, ends[:, d])
        if bool((hi - lo != 1).any()):
            # a piece spans several cells: not a plain grid, checked by corner parity
            return _check_parity(tensor, shape, ranks, offsets, lengths)
        cells_per_dim.append(len(cuts) - 1)
        index = index * (len(cuts) - 1) + lo
    order = np.argsort(index, kind="stable")
    ordered = index[order]
    dup = np.nonzero(ordered[1:] == ordered[:-1])[0]
    problems: list[CoverageProblem] = []
    if len(dup):
        i = int(dup[0])
        problems.append(
            _overlap(
                tensor,
                _piece_at(ranks, offsets, lengths, int(order[i])),
                _piece_at(ranks, offsets, lengths, int(order[i + 1])),
            )
        )
    cells = math.prod(cells_per_dim)
    distinct = sorted_unique(ordered)
    if len(distinct) < cells:
        missing = np.nonzero(distinct != np.arange(len(distinct)))[0]
        cell = int(missing[0]) if len(missing) else len(distinct)
        problems.append(
            _missing_cell(tensor, shape, offsets, ends, cell, cells_per_dim, ranks, index)
        )
    return problems


def _check_parity(
    tensor: str, shape: Sequence[int], ranks: Int64s, offsets: Int64s, lengths: Int64s
) -> list[CoverageProblem]:
    """Any layout of in-bounds, non-empty pieces in O(n log n) (see decision.parity): a
    clean tiling, or the overlap and the gap found at the points where the corner parity
    says to look."""
    total = math.prod(shape)
    # float first: a sum past 2^62 cannot be a real tensor's volume (and would wrap)
    rough = float(lengths.astype(np.float64).prod(axis=1).sum())
    volume = int(lengths.prod(axis=1).sum()) if rough < 2.0**62 else -1
    if not len(ranks):
        spans = ", ".join(f"0:{s}" for s in shape)
        return [CoverageProblem(tensor, "uncovered", f"[{spans}] is held by no rank", ())]
    kept_shape, o, ln, kept = parity.reduce_full(shape, offsets, lengths)
    if not kept_shape:  # every piece is the whole tensor
        if len(ranks) == 1:
            return []
        return [
            _overlap(
                tensor, _piece_at(ranks, offsets, lengths, 0), _piece_at(ranks, offsets, lengths, 1)
            )
        ]
    points = parity.mismatches(kept_shape, o, ln)
    if not len(points) and volume == total:
        return []
    problems = _named_at(tensor, shape, ranks, offsets, lengths, points, (kept, o, ln))
    if not problems:  # an element held three (or five...) times: odd, so no corner tells
        problems.append(
            CoverageProblem(
                tensor,
                "overlap",
                f"the pieces hold {volume if volume >= 0 else 'more than 2^62'} elements of the "
                f"tensor's {total}: some are held three times or more",
                tuple(sorted({int(r) for r in ranks[:16]})),
            )
        )
    return problems


def _named_at(
    tensor: str,
    shape: Sequence[int],
    ranks: Int64s,
    offsets: Int64s,
    lengths: Int64s,
    points: Int64s,
    reduced: tuple[list[int], Int64s, Int64s],
) -> list[CoverageProblem]:
    """The first overlap and the first gap found around the points where the corner parity
    differs from the tensor's, overlap first. `reduced`: the dimensions kept, and the
    offsets and lengths in them (parity.reduce_full), where the points lie."""
    kept, o, ln = reduced
    kept_shape = [shape[d] for d in kept]
    overlap: CoverageProblem | None = None
    gap: CoverageProblem | None = None
    for point in points:
        idx = parity.near(point, o, ln)
        pair = parity.held_twice(idx, o, ln) if overlap is None else None
        if pair is not None:
            a, b = (_piece_at(ranks, offsets, lengths, i) for i in pair)
            overlap = _overlap(tensor, a, b)
        cell = parity.empty_cell(point, kept_shape, idx, o, ln) if gap is None else None
        if cell is not None:
            spans = [f"0:{s}" for s in shape]
            for d, c in zip(kept, cell.tolist(), strict=True):
                spans[d] = f"{c}:{c + 1}"
            gap = _unheld(tensor, spans, [int(ranks[i]) for i in idx])
        if overlap is not None and gap is not None:
            break
    return [p for p in (overlap, gap) if p is not None]


def _cuts(starts: Int64s, ends: Int64s, size: int) -> Int64s:
    """Every boundary along one dimension of `size`, sorted: by marking them when the
    dimension is not much longer than the list (a bitmap is O(n), a sort O(n log n))."""
    if size <= 8 * len(starts) + 1024:
        marks = np.zeros(size + 1, dtype=bool)
        marks[starts] = True
        marks[ends] = True
        marks[[0, size]] = True
        return np.flatnonzero(marks).astype(np.int64)
    return sorted_unique(np.concatenate((starts, ends, [0, size])))


def sorted_unique(values: Int64s) -> Int64s:
    """np.unique by sorting: numpy 2's default hash-based unique is ~10x slower here."""
    ordered = np.sort(values)
    keep = np.empty(len(ordered), dtype=bool)
    keep[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


def _piece_at(ranks: Int64s, offsets: Int64s, lengths: Int64s, i: int) -> Piece:
    return Piece(
        int(ranks[i]), tuple(int(v) for v in offsets[i]), tuple(int(v) for v in lengths[i])
    )


def _missing_cell(
    tensor: str,
    shape: Sequence[int],
    offsets: Int64s,
    ends: Int64s,
    cell: int,
    cells_per_dim: list[int],
    ranks: Int64s,
    index: Int64s,
) -> CoverageProblem:
    """The grid's cell `cell` (row-major) no piece holds, named with the ranks of the pieces
    in the cells beside it (`index`: each piece's cell)."""
    spans: list[str] = []
    at: list[int] = []
    rest = cell
    for d in reversed(range(len(cells_per_dim))):
        rest, k = divmod(rest, cells_per_dim[d])
        cuts = _cuts(offsets[:, d], ends[:, d], shape[d])
        spans.insert(0, f"{int(cuts[k])}:{int(cuts[k + 1])}")
        at.insert(0, k)
    beside = [
        cell + step * math.prod(cells_per_dim[d + 1 :])
        for d in range(len(cells_per_dim))
        for step in (-1, 1)
        if 0 <= at[d] + step < cells_per_dim[d]
    ]
    return _unheld(tensor, spans, ranks[np.isin(index, beside)].tolist())


def _check_pieces(
    tensor: str, shape: Sequence[int], pieces: Sequence[Piece]
) -> list[CoverageProblem]:
    shape = tuple(shape)
    problems: list[CoverageProblem] = []
    for p in pieces:
        if len(p.offset) != len(shape) or len(p.length) != len(shape):
            problems.append(
                CoverageProblem(
                    tensor,
                    "shape",
                    f"piece {p.describe()} has {len(p.offset)} dimensions, the tensor "
                    f"{len(shape)} ({list(shape)})",
                    (p.rank,),
                )
            )
        elif any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(p.offset, p.length, shape, strict=True)
        ):
            problems.append(
                CoverageProblem(
                    tensor,
                    "out_of_bounds",
                    f"piece {p.describe()} lies outside the tensor's shape {list(shape)}",
                    (p.rank,),
                )
            )
    if problems:
        return problems
    live = [p for p in pieces if p.volume > 0]
    problems += _tile(tensor, shape, live, 0, (), ())
    total = sum(p.volume for p in live)
    if not problems and total != math.prod(shape):
        # Disjoint and in bounds but short: some region is held by no rank.
        problems.append(
            CoverageProblem(
                tensor,
                "uncovered",
                f"the pieces hold {total} of {math.prod(shape)} elements",
                tuple(sorted({p.rank for p in live})),
            )
        )
    return problems


def _tile(
    tensor: str,
    shape: tuple[int, ...],
    pieces: Sequence[Piece],
    dim: int,
    fixed_offset: tuple[int, ...],
    fixed_length: tuple[int, ...],
) -> list[CoverageProblem]:
    """Pieces agreeing on dims < `dim` must tile dims >= `dim` of the tensor."""
    if dim == len(shape) or not pieces:
        if len(pieces) > 1:
            a, b = pieces[0], pieces[1]
            return [_overlap(tensor, a, b)]
        return []
    slabs: dict[tuple[int, int], list[Piece]] = {}
    for p in pieces:
        slabs.setdefault((p.offset[dim], p.length[dim]), []).append(p)
    intervals = sorted(slabs)
    # Slabs along `dim` must not overlap one another...
    if any(b[0] < a[0] + a[1] for a, b in itertools.pairwise(intervals)):
        return _pairwise(tensor, pieces)  # fewer than FAST_MIN_PIECES: cheap
    # ...and must leave no gap, and each must tile the remaining dimensions.
    problems: list[CoverageProblem] = []
    cursor = 0
    for start, length in intervals:
        if start > cursor:
            problems.append(
                _gap(tensor, shape, dim, cursor, start, fixed_offset, fixed_length, pieces)
            )
        cursor = max(cursor, start + length)
        problems += _tile(
            tensor,
            shape,
            slabs[(start, length)],
            dim + 1,
            (*fixed_offset, start),
            (*fixed_length, length),
        )
        if len(problems) > 20:
            return problems
    if cursor < shape[dim]:
        problems.append(
            _gap(tensor, shape, dim, cursor, shape[dim], fixed_offset, fixed_length, pieces)
        )
    return problems


def _pairwise(tensor: str, pieces: Sequence[Piece]) -> list[CoverageProblem]:
    ordered = sorted(pieces, key=lambda p: p.offset)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b.offset[0] >= a.offset[0] + a.length[0]:
                break
            if all(
                bo < ao + an and ao < bo + bn
                for ao, an, bo, bn in zip(a.offset, a.length, b.offset, b.length, strict=True)
            ):
                return [_overlap(tensor, a, b)]
    return []


def _overlap(tensor: str, a: Piece, b: Piece) -> CoverageProblem:
    lo = [max(x, y) for x, y in zip(a.offset, b.offset, strict=True)]
    hi = [
        min(x + n, y + m) for x, n, y, m in zip(a.offset, a.length, b.offset, b.length, strict=True)
    ]
    region = ", ".join(f"{low}:{high}" for low, high in zip(lo, hi, strict=True))
    return CoverageProblem(
        tensor,
        "overlap",
        f"[{region}] is held twice: by {a.describe()} and by {b.describe()}",
        tuple(sorted({a.rank, b.rank})),
    )


def _gap(
    tensor: str,
    shape: tuple[int, ...],
    dim: int,
    start: int,
    end: int,
    fixed_offset: tuple[int, ...],
    fixed_length: tuple[int, ...],
    pieces: Sequence[Piece],
) -> CoverageProblem:
    spans = [f"{o}:{o + n}" for o, n in zip(fixed_offset, fixed_length, strict=True)]
    spans.append(f"{start}:{end}")
    spans += [f"0:{s}" for s in shape[dim + 1 :]]
    return _unheld(tensor, spans, [p.rank for p in pieces])


def _unheld(tensor: str, spans: Sequence[str], near: Sequence[int]) -> CoverageProblem:
    """A region no piece holds, named with the ranks of the pieces beside it (16 at most)."""
    shown = sorted(set(near))[:16]
    said = f" (neighbouring pieces on ranks {','.join(map(str, shown))})" if shown else ""
    region = ", ".join(spans)
    return CoverageProblem(
        tensor, "uncovered", f"[{region}] is held by no rank{said}", tuple(shown)
    )


def check_flat(
    tensor: str, total: int, ranges: Sequence[tuple[int, int, int]]
) -> list[CoverageProblem]:
    """FSDP-style flat shards: (rank, offset, length) ranges over `total` elements (padding
    already subtracted by the caller) must tile [0, total)."""
    return check(tensor, (total,), [Piece(r, (o,), (n,)) for r, o, n in ranges])
