"""Shard coverage: the pieces of a logical tensor are in bounds, disjoint and add up to it.

In bounds + pairwise disjoint + volumes summing to the whole proves the pieces tile the
tensor, so no separate hole check is needed (coverage by placement, not by count). Grid
layouts (every TP/PP/FSDP split) are checked in O(pieces log pieces): pieces are grouped
into slabs that share their interval along the first dimension, slabs must be disjoint
along it, and each slab must tile the remaining dimensions, recursively. A layout that is
not a grid falls back to a pairwise check, capped.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

# Pairwise checking is quadratic; irregular (non-grid) layouts larger than this are refused
# as unverifiable rather than left to run for minutes.
PAIRWISE_CAP = 4096


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


def check_arrays(
    tensor: str, shape: Sequence[int], ranks: Int64s, offsets: Int64s, lengths: Int64s
) -> list[CoverageProblem] | None:
    """The grid fast path, vectorised: pieces as columns (ranks (n,), offsets and lengths
    (n, dims)). Cut every dimension at every piece boundary; when each piece is exactly one
    cell of that grid, the pieces tile the tensor iff their cells are distinct and as many as
    the cells. Returns None when the layout is not such a grid (the caller falls back)."""
    n, dims = offsets.shape
    shape_arr = np.asarray(tuple(shape), dtype=np.int64)
    ends = offsets + lengths
    if dims != len(shape) or bool(
        (offsets < 0).any() or (lengths < 0).any() or (ends > shape_arr).any()
    ):
        return None  # the slow path names the offending pieces
    live = lengths.prod(axis=1) > 0
    if not live.all():
        ranks, offsets, lengths, ends = ranks[live], offsets[live], lengths[live], ends[live]
        n = len(ranks)
    cells_per_dim = []
    index = np.zeros(n, dtype=np.int64)
    for d in range(dims):
        cuts = _sorted_unique(np.concatenate((offsets[:, d], ends[:, d], [0, shape[d]])))
        lo = np.searchsorted(cuts, offsets[:, d])
        hi = np.searchsorted(cuts, ends[:, d])
        if bool((hi - lo != 1).any()):
            return None  # a piece spans several cells: not a plain grid
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
    distinct = _sorted_unique(ordered)
    if len(distinct) < cells:
        missing = np.nonzero(distinct != np.arange(len(distinct)))[0]
        cell = int(missing[0]) if len(missing) else len(distinct)
        problems.append(_missing_cell(tensor, shape, offsets, ends, cell, cells_per_dim, ranks))
    return problems


def _sorted_unique(values: Int64s) -> Int64s:
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
) -> CoverageProblem:
    spans = []
    for d in reversed(range(len(cells_per_dim))):
        cell, k = divmod(cell, cells_per_dim[d])
        cuts = _sorted_unique(np.concatenate((offsets[:, d], ends[:, d], [0, shape[d]])))
        spans.append(f"{int(cuts[k])}:{int(cuts[k + 1])}")
    region = ", ".join(reversed(spans))
    return CoverageProblem(
        tensor,
        "uncovered",
        f"[{region}] is held by no rank",
        tuple(sorted({int(r) for r in ranks[:16]})),
    )


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
        if len(slabs) > PAIRWISE_CAP:
            return [_unverifiable(tensor, pieces)]
        return _pairwise(tensor, pieces)
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
    return CoverageProblem(
        tensor,
        "uncovered",
        f"[{', '.join(spans)}] is held by no rank (neighbouring pieces on ranks "
        f"{','.join(str(r) for r in sorted({p.rank for p in pieces})[:16])})",
        tuple(sorted({p.rank for p in pieces})),
    )


def _unverifiable(tensor: str, pieces: Sequence[Piece]) -> CoverageProblem:
    return CoverageProblem(
        tensor,
        "unverifiable",
        f"{len(pieces)} pieces that do not form a grid: more than the {PAIRWISE_CAP} this "
        "coordinator checks pairwise",
        tuple(sorted({p.rank for p in pieces}))[:16],
    )


def check_flat(
    tensor: str, total: int, ranges: Sequence[tuple[int, int, int]]
) -> list[CoverageProblem]:
    """FSDP-style flat shards: (rank, offset, length) ranges over `total` elements (padding
    already subtracted by the caller) must tile [0, total)."""
    return check(tensor, (total,), [Piece(r, (o,), (n,)) for r, o, n in ranges])
