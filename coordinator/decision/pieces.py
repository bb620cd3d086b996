"""A cohort's layout pieces as numpy columns, and coverage of every tensor at once.

The coverage check used to walk each tensor's pieces as Python objects: a million pieces
cost seconds before any arithmetic (and 62,500 tensors of 16 pieces each, every one under
the vectorised path's threshold, 8.7 s). Here the pieces of every rank are read straight
from their wire columns (PieceColumns, little-endian bytes) into arrays, tensors become
integer ids, and one pass over all pieces of a replica settles every tensor that tiles:

- a grid layout (every TP/PP/FSDP split): cut each dimension of each tensor at its pieces'
  boundaries; a piece must be exactly one cell, and the cells of a tensor must be distinct
  and as many as its grid has;
- any other layout: corner parity (decision.parity), the corners of every tensor keyed
  apart by a per-tensor base.

Only the tensors that fail (or that the arrays cannot key without overflow) are examined
one by one, by decision.coverage, which names what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from cohortgate.coordinator.contract.layout import Layout, PieceColumns
from cohortgate.coordinator.decision.coverage import sorted_unique
from cohortgate.coordinator.decision.parity import corner_masks, odd_keys_of

Int64s = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
# Keys past this could wrap an int64 once multiplied out: such tensors go one by one.
KEY_LIMIT = 2**62


@dataclass
class Rows:
    """Pieces of tensors of one number of dimensions `dims`, as columns."""

    dims: int
    rank: Int64s
    tensor: Int64s  # the tensor's id (CohortPieces.names)
    offsets: Int64s  # (n, dims)
    lengths: Int64s  # (n, dims)
    replicated: Bools

    def take(self, index: Int64s | Bools) -> Rows:
        if index.dtype == np.bool_ and bool(index.all()):
            return self
        return Rows(
            self.dims,
            self.rank[index],
            self.tensor[index],
            self.offsets[index],
            self.lengths[index],
            self.replicated[index],
        )


@dataclass
class _Table:
    """One distinct tensor table (names, dims, shapes) as ranks send it: ranks of one
    pipeline stage send the same one, so each is read once, not once per rank."""

    ids: Int64s
    dims: npt.NDArray[np.uint8]
    shape_at: Int64s  # where each tensor's shape starts in `shapes`
    shapes: Int64s
    ranks: list[int] = field(default_factory=list)


class CohortPieces:
    """Every piece the cohort's layouts declare, by replica (dp position) and by number of
    dimensions, with tensors as ids; each tensor's logical shape, and the tensors whose
    ranks disagree on it."""

    def __init__(self, layouts: Mapping[int, Layout], large: int | None = None) -> None:
        self.large = LARGE if large is None else large
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        self._by_names: dict[tuple[str, ...], Int64s] = {}
        tables: dict[tuple[tuple[str, ...], bytes, bytes], _Table] = {}
        parts: dict[tuple[int, int], list[Rows]] = {}
        self.present: dict[int, list[Int64s]] = {}  # replica -> ids of tensors held
        for rank in sorted(layouts):
            lay = layouts[rank]
            cols = lay.columns()
            replica = lay.position.get("dp", 0)
            key = (cols.tensors, cols.dims, cols.shapes)
            table = tables.get(key)
            if table is None:
                dims = np.frombuffer(cols.dims, dtype=np.uint8)
                shape_at = np.zeros(len(dims), dtype=np.int64)
                np.cumsum(dims[:-1], out=shape_at[1:])
                table = tables[key] = _Table(
                    self._tensor_ids(cols.tensors),
                    dims,
                    shape_at,
                    np.frombuffer(cols.shapes, dtype=f"<i{cols.width}").astype(np.int64),
                )
            table.ranks.append(rank)
            counts = np.frombuffer(cols.counts, dtype="<u4").astype(np.int64)
            self.present.setdefault(replica, []).append(table.ids[counts > 0])
            for rows in _rows(rank, cols, table, counts):
                parts.setdefault((replica, rows.dims), []).append(rows)
        # replica -> number of dimensions -> its pieces
        self.rows: dict[int, dict[int, Rows]] = {}
        for (replica, ndims), held in parts.items():
            self.rows.setdefault(replica, {})[ndims] = _concat(ndims, held)
        self.shapes: dict[int, Int64s] = {}  # dims -> (tensors, dims) logical shapes
        self.dims_of = np.full(len(self.names), -1, dtype=np.int64)
        self.conflicts: dict[int, dict[int, tuple[int, ...]]] = {}  # id -> rank -> shape
        self.conflicted = np.zeros(len(self.names), dtype=bool)
        self.conflicts_unnamed = 0
        self._shapes(list(tables.values()))

    def _tensor_ids(self, tensors: tuple[str, ...]) -> Int64s:
        ids = self._by_names.get(tensors)
        if ids is None:
            index = self._ids
            if not index:  # the first table: every name is new
                index.update(zip(tensors, range(len(tensors)), strict=True))
                self.names.extend(tensors)
            for name in tensors:
                if name not in index:
                    index[name] = len(self.names)
                    self.names.append(name)
            ids = self._by_names[tensors] = np.fromiter(
                (index[n] for n in tensors), dtype=np.int64, count=len(tensors)
            )
        return ids

    def _shapes(self, tables: list[_Table]) -> None:
        """Each tensor's logical shape, from the first table holding it; tensors that
        another table gives another shape are conflicts (every rank's shape listed)."""
        count = len(self.names)
        bad = np.zeros(count, dtype=bool)
        for table in tables:
            for d in np.unique(table.dims).tolist():
                sel = np.flatnonzero(table.dims == d)
                ids = table.ids[sel]
                rows = table.shapes[table.shape_at[sel, None] + np.arange(d, dtype=np.int64)]
                shape = self.shapes.setdefault(d, np.zeros((count, d), dtype=np.int64))
                known = self.dims_of[ids]
                bad[ids[(known >= 0) & (known != d)]] = True
                same = known == d
                differs = same & (shape[ids] != rows).any(axis=1)
                bad[ids[differs]] = True
                new = known < 0
                shape[ids[new]] = rows[new]
                self.dims_of[ids[new]] = d
        self.conflicted = bad
        # Every rank's shape, for the first CONFLICTS_NAMED of them (by name); the rest are
        # counted (a rank declaring 100k tensors all of another shape costs no more).
        named = sorted(np.flatnonzero(bad).tolist(), key=lambda t: self.names[t])
        self.conflicts_unnamed = max(0, len(named) - CONFLICTS_NAMED)
        named = named[:CONFLICTS_NAMED]
        for table in tables:
            where = np.full(count, -1, dtype=np.int64)
            where[table.ids] = np.arange(len(table.ids))
            for tensor in named:
                i = int(where[tensor])
                if i >= 0:
                    start, d = int(table.shape_at[i]), int(table.dims[i])
                    dims = tuple(int(v) for v in table.shapes[start : start + d])
                    self.conflicts.setdefault(tensor, {}).update(dict.fromkeys(table.ranks, dims))
        self.conflicts = {t: dict(sorted(self.conflicts[t].items())) for t in named}

    def held_by(self, replica: int) -> Bools:
        """Which tensors (by id) some rank of `replica` holds a piece of."""
        out = np.zeros(len(self.names), dtype=bool)
        for ids in self.present.get(replica, []):
            out[ids] = True
        return out

    def examine(self, replica: int) -> tuple[dict[int, Rows], list[int]]:
        """What the one-by-one check must examine in `replica`: the large tensors (`large`
        pieces or more, with their pieces: the columnar check settles or names each in one
        pass, no faster batched), and the other tensors that do not plainly tile, by name.
        Tensors whose shapes conflict are left out (reported as such)."""
        large: dict[int, Rows] = {}
        failing: set[int] = set()
        for dims, held in self.rows.get(replica, {}).items():
            rows = held.take(~self.conflicted[held.tensor]) if self.conflicts else held
            counts = np.bincount(rows.tensor, minlength=len(self.names))
            big = np.flatnonzero(counts >= self.large)
            if len(big):
                large.update(_split(rows.take(np.isin(rows.tensor, big)), big))
                rows = rows.take(counts[rows.tensor] < self.large)
            failing.update(_untiled(rows, self.shapes.get(dims, np.zeros((0, dims), np.int64))))
        order = sorted(large, key=lambda t: self.names[t])
        return {t: large[t] for t in order}, sorted(failing, key=lambda t: self.names[t])

    def pieces_of(self, replica: int, tensor: int) -> Rows:
        rows = self.rows[replica][int(self.dims_of[tensor])]
        return rows.take(np.flatnonzero(rows.tensor == tensor))


# From this many pieces a tensor is checked alone (decision.coverage.check_columns).
LARGE = 4096
# Tensors whose shapes ranks disagree on, named with every rank's shape; past this, counted.
CONFLICTS_NAMED = 20


def _split(rows: Rows, ids: Int64s) -> dict[int, Rows]:
    """`rows` by tensor, for the tensors `ids`."""
    if len(ids) == 1:
        return {int(ids[0]): rows}
    order = np.argsort(rows.tensor, kind="stable")
    ordered = rows.take(order)
    starts = np.searchsorted(ordered.tensor, ids, side="left").tolist()
    ends = [*starts[1:], len(order)]
    return {
        int(t): ordered.take(np.arange(a, b))
        for t, a, b in zip(ids.tolist(), starts, ends, strict=True)
    }


def _rows(rank: int, cols: PieceColumns, table: _Table, counts: Int64s) -> Iterable[Rows]:
    """One rank's pieces, split by number of dimensions (most layouts: one)."""
    n = len(cols)
    if not n:
        return
    tensor = np.repeat(table.ids, counts)
    dims = np.repeat(table.dims.astype(np.int64), counts)
    offsets = np.frombuffer(cols.offsets, dtype=f"<i{cols.width}").astype(np.int64)
    lengths = np.frombuffer(cols.lengths, dtype=f"<i{cols.width}").astype(np.int64)
    replicated = np.frombuffer(cols.replicated, dtype=np.uint8).astype(bool)
    ranks = np.full(n, rank, dtype=np.int64)
    first = int(dims[0])
    if bool((dims == first).all()):
        yield Rows(
            first,
            ranks,
            tensor,
            offsets.reshape(n, first),
            lengths.reshape(n, first),
            replicated,
        )
        return
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(dims[:-1], out=start[1:])
    for d in np.unique(dims).tolist():
        sel = np.flatnonzero(dims == d)
        at = start[sel, None] + np.arange(d, dtype=np.int64)
        yield Rows(d, ranks[sel], tensor[sel], offsets[at], lengths[at], replicated[sel])


def _concat(dims: int, parts: list[Rows]) -> Rows:
    if len(parts) == 1:
        return parts[0]
    return Rows(
        dims,
        np.concatenate([p.rank for p in parts]),
        np.concatenate([p.tensor for p in parts]),
        np.concatenate([p.offsets for p in parts]),
        np.concatenate([p.lengths for p in parts]),
        np.concatenate([p.replicated for p in parts]),
    )


def _untiled(rows: Rows, shapes: Int64s) -> set[int]:
    """The tensors among `rows` (one replica, one number of dimensions) that may not tile:
    a piece out of bounds, replicated copies that differ, no live piece, or a grid or
    corner-parity test failed. The rest tile exactly."""
    if not len(rows.tensor):
        return set()
    shape = shapes[rows.tensor]
    ends = rows.offsets + rows.lengths
    bad = np.zeros(len(shapes), dtype=bool)
    outside = (ends > shape) | (rows.offsets < 0) | (rows.lengths < 0)
    bad[rows.tensor[outside.any(axis=1)]] = True
    # Replicated copies: one counts, when every copy is the same box as the first.
    rep = np.flatnonzero(rows.replicated)
    keep = ~rows.replicated
    if len(rep):
        ids = rows.tensor[rep]
        first = np.full(len(shapes), -1, dtype=np.int64)
        first[ids[::-1]] = rep[::-1]  # the lowest index wins
        mine = first[ids]
        differs = (rows.offsets[rep] != rows.offsets[mine]).any(axis=1) | (
            rows.lengths[rep] != rows.lengths[mine]
        ).any(axis=1)
        bad[ids[differs]] = True
        keep[mine] = True
    live = keep & (rows.lengths > 0).all(axis=1)
    held = np.zeros(len(shapes), dtype=bool)
    held[rows.tensor] = True
    has_live = np.zeros(len(shapes), dtype=bool)
    has_live[rows.tensor[live]] = True
    bad |= held & ~has_live  # all its pieces empty: held by nobody
    rows = rows.take(live & ~bad[rows.tensor])
    if len(rows.tensor):
        nongrid = _grid(rows, shapes, bad)
        if nongrid.any():
            _parity(rows.take(nongrid[rows.tensor]), shapes, bad)
    return set(np.flatnonzero(bad).tolist())


def _grid(rows: Rows, shapes: Int64s, bad: Bools) -> Bools:
    """Grid test for every tensor of `rows` (in-bounds, live, one copy of each replicated
    piece): marks in `bad` the tensors whose grid cells repeat or are missing; returns the
    tensors (a mask over ids) that are not grids at all, for the parity test.

    Per dimension, every tensor is cut at each of its pieces' boundaries (and at 0 and its
    size). A piece of a grid spans exactly one cut-to-cut interval in every dimension; a
    tensor's grid tiles iff its pieces are as many as its cells and no two share one."""
    count = len(shapes)
    n, dims = rows.offsets.shape
    tensor = rows.tensor
    nongrid = np.zeros(count, dtype=bool)
    cell = np.zeros(n, dtype=np.int64)
    cells = np.ones(count, dtype=np.int64)
    cells_f = np.ones(count, dtype=np.float64)
    starts = np.arange(count, dtype=np.int64)
    for d in range(dims):
        lo = rows.offsets[:, d]
        hi = lo + rows.lengths[:, d]
        size = shapes[:, d]
        radix = int(size.max(initial=0)) + 1
        if count * radix >= KEY_LIMIT:
            bad[np.unique(tensor)] = True  # keys would wrap: one by one
            return nongrid
        # Keys: a tensor's cuts in [its id * radix, + radix), so one pass serves them all.
        # The cuts are where pieces start (and each tensor's 0 and size); a grid piece then
        # ends on the next cut, which the lookups check, so ends need no sorting.
        base: Int64s | int = tensor * radix if count > 1 else 0
        first_key = starts * radix
        inner = lo > 0
        below, is_cut = _ranker(
            ((base + lo)[inner] if count > 1 else lo[inner], first_key, first_key + size),
            count * radix,
        )
        at_lo, end_key = below(base + lo), base + hi
        at_hi = below(end_key)
        # the piece spans a cut, or ends where no cut is (a gap after it)
        nongrid[tensor[(at_hi - at_lo != 1) | ~is_cut(end_key, at_hi)]] = True
        first = below(first_key)
        per_tensor = below(first_key + size) - first  # cells along d
        cell = cell * per_tensor[tensor] + (at_lo - first[tensor])
        cells *= per_tensor
        cells_f *= per_tensor
    grid = ~nongrid[tensor]
    pieces = np.bincount(tensor[grid], minlength=count)
    short = (cells_f != pieces) | (cells_f >= KEY_LIMIT)
    bad |= short & (pieces > 0)
    ok = grid & ~bad[tensor]
    if ok.any():
        sizes = np.where(bad | nongrid, 0, pieces)
        base_of = np.zeros(count, dtype=np.int64)
        np.cumsum(sizes[:-1], out=base_of[1:])
        hits = np.bincount(base_of[tensor[ok]] + cell[ok], minlength=int(sizes.sum()))
        twice = np.flatnonzero(hits != 1)
        if len(twice):
            owner = np.searchsorted(base_of, twice, side="right") - 1
            bad[owner] = True
    return nongrid & ~bad


def _ranker(
    keys: tuple[Int64s, ...], space: int
) -> tuple[Callable[[Int64s], Int64s], Callable[[Int64s, Int64s], Bools]]:
    """For cut keys (all in [0, space)): x -> how many distinct cuts are below x, and
    (x, below(x)) -> is x a cut. By a prefix count over the key space when it is small
    (the usual grid: a dimension cut in a few hundred places), else by sorting the keys
    and binary search."""
    n = sum(len(k) for k in keys)
    if space <= 2 * n + 1024:
        marks = np.zeros(space + 1, dtype=bool)
        for part in keys:
            marks[part] = True
        counts = np.zeros(space + 2, dtype=np.int32 if space < 2**31 else np.int64)
        np.cumsum(marks, out=counts[1:])
        return (lambda x: counts[x].astype(np.int64)), (lambda x, _: marks[x])
    cuts = sorted_unique(np.concatenate(keys))
    last = len(cuts) - 1
    return (
        lambda x: np.searchsorted(cuts, x, side="left").astype(np.int64),
        lambda x, at: cuts[np.minimum(at, last)] == x,
    )


def _parity(rows: Rows, shapes: Int64s, bad: Bools) -> None:
    """Corner parity (see decision.parity) for every tensor of `rows` at once: each
    tensor's corner keys offset by its own base, so one count settles them all. Marks in
    `bad` the tensors whose odd corners are not their box's, or whose volumes do not sum."""
    dims = rows.offsets.shape[1]
    ids = np.unique(rows.tensor)
    local = np.searchsorted(ids, rows.tensor)
    shape = shapes[ids]
    radix = shape + 1
    space_f = np.prod(radix.astype(np.float64), axis=1)
    volume_f = np.prod(shape, axis=1, dtype=np.float64)
    if float(space_f.sum()) >= KEY_LIMIT or float(volume_f.max()) >= KEY_LIMIT:
        bad[ids] = True  # keys or volumes would wrap: one by one
        return
    space = np.prod(radix, axis=1)
    base = np.zeros(len(ids), dtype=np.int64)
    np.cumsum(space[:-1], out=base[1:])
    stride = np.ones((len(ids), dims), dtype=np.int64)
    for d in reversed(range(dims - 1)):
        stride[:, d] = stride[:, d + 1] * radix[:, d + 1]
    ends = rows.offsets + rows.lengths
    masks = corner_masks(dims)
    keys = np.concatenate(
        [base[local] + (np.where(m, ends, rows.offsets) * stride[local]).sum(axis=1) for m in masks]
    )
    boxes = np.concatenate([base + (np.where(m, shape, 0) * stride).sum(axis=1) for m in masks])
    odd = odd_keys_of(keys, int(space.sum()))
    # The box corners are distinct per tensor: a key in exactly one of the two lists is a
    # point where the parity differs from the box's.
    both = np.sort(np.concatenate((odd, np.unique(boxes))))
    once = np.ones(len(both), dtype=bool)
    if len(both) > 1:
        same = both[1:] == both[:-1]
        once[1:] &= ~same
        once[:-1] &= ~same
    differ = both[once]
    bad[ids[np.searchsorted(base, differ, side="right") - 1]] = True
    # The volumes must sum to each tensor's; the float sum guards the int64 one from a
    # wrap (a thousand whole-tensor copies summing to the tensor's volume modulo 2^64).
    piece_volume = rows.lengths.prod(axis=1)
    volume = np.zeros(len(ids), dtype=np.int64)
    np.add.at(volume, local, piece_volume)
    rough = np.zeros(len(ids), dtype=np.float64)
    np.add.at(rough, local, piece_volume.astype(np.float64))
    bad[ids[(volume != np.prod(shape, axis=1)) | (rough > 1.5 * volume_f)]] = True
