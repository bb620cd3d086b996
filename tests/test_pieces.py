"""A cohort's pieces as columns (decision.pieces): every tensor of every rank checked at
once, against a brute-force count of every cell; the wire's columns and their validation."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.contract.errors import InvalidArgument, LimitExceeded
from cohortgate.coordinator.contract.layout import Layout, PieceColumns, ShardPiece, layout
from cohortgate.coordinator.decision.checks.coverage import DETAILED, CoverageCheck
from cohortgate.coordinator.decision.coverage import OUTSIDE_NAMED
from cohortgate.coordinator.decision.pieces import CONFLICTS_NAMED, LARGE, CohortPieces
from cohortgate.coordinator.decision.verdict import Level
from tests.helpers import InProcessCoordinator, examples, join_request, manifest_of, run_rank
from tests.test_parity import brute
from tests.test_parity import layouts as tensor_layouts

Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


@pytest.fixture(scope="module")
def coordinator() -> Iterator[InProcessCoordinator]:
    c = InProcessCoordinator(join_deadline=30.0)
    yield c
    c.stop()


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


def test_columns_round_trip_at_either_width() -> None:
    small = [
        ShardPiece("a", (4, 6), (0, 3), (4, 3)),
        ShardPiece("b", (), (), ()),
        ShardPiece("a", (4, 6), (0, 0), (4, 3)),
        ShardPiece("c", (8,), (0,), (8,), True),
    ]
    cols = PieceColumns.of(small)
    assert cols.width == 4 and len(cols) == 4
    assert list(cols) == [small[0], small[2], small[1], small[3]]  # grouped by tensor
    big = [ShardPiece("flat", (2**40,), (2**39,), (2**39,))]
    assert PieceColumns.of(big).width == 8 and list(PieceColumns.of(big)) == big
    sent = wire.layout_from_pb(wire.layout_to_pb(Layout({}, {}, pieces=tuple(big))))
    assert list(sent.pieces) == big
    with pytest.raises(ValueError, match="two logical shapes"):
        PieceColumns.of([ShardPiece("a", (4,), (0,), (2,)), ShardPiece("a", (8,), (2,), (2,))])


def columns(**fields: object) -> pb.Layout:
    good = wire.layout_to_pb(
        layout(0, tp=1).split("w", (8, 8), 0, 0, 1).replicated("b", (8,)).build()
    )
    for name, value in fields.items():
        setattr(good.columns, name, value)
    return good


@pytest.mark.parametrize("column", ["shapes", "offsets", "lengths"])
def test_every_value_of_a_column_is_bounded_by_its_own_top_byte(column: str) -> None:
    """The columns' range check reads each integer's top byte: the last value of a column
    at the top of its width's range (2^31 - 1 in 4 bytes, 2^62 - 1 in 8) is taken, one past
    it refused, whatever the values before it."""
    good = columns()
    width = good.columns.width
    top = {4: 2**31, 8: 2**62}[width]
    data = bytearray(getattr(good.columns, column))
    assert len(data) >= 2 * width, "two values at least: the last one is the one changed"
    data[-width:] = (top - 1).to_bytes(width, "little")
    wire.layout_from_pb(columns(**{column: bytes(data)}))
    data[-width:] = top.to_bytes(width, "little")
    with pytest.raises(InvalidArgument) as raised:
        wire.layout_from_pb(columns(**{column: bytes(data)}))
    assert str(raised.value) == (
        f"layout columns: {column} holds a value outside 0 to 2^62; shapes, offsets and "
        "lengths are non-negative"
    )


def test_replicated_takes_0_and_1_and_refuses_every_other_byte() -> None:
    wire.layout_from_pb(columns(replicated=b"\x00\x01"))
    with pytest.raises(InvalidArgument) as short:
        wire.layout_from_pb(columns(replicated=b"\x00"))
    assert str(short.value) == (
        "layout columns: replicated is 1 bytes; 2 pieces of 2 tensors need 2"
    )
    for byte in range(2, 256):
        with pytest.raises(InvalidArgument) as raised:
            wire.layout_from_pb(columns(replicated=bytes([0, byte])))
        assert str(raised.value) == "layout columns: replicated holds a byte other than 0 or 1"


def of_tensors(*tensors: str) -> pb.Layout:
    """Columns of tensors that hold no pieces: names alone are what is checked."""
    n = len(tensors)
    laid = columns(dims=bytes(n), counts=bytes(4 * n), shapes=b"", offsets=b"", lengths=b"")
    laid.columns.replicated = b""
    del laid.columns.tensors[:]
    laid.columns.tensors.extend(tensors)
    return laid


def test_layout_tensor_names_are_checked_at_their_bounds() -> None:
    wire.layout_from_pb(of_tensors("a" * wire.MAX_NAME, "b"))
    for tensors, says in (
        (("a", ""), "layout tensor 1 is empty; it is required"),
        (
            ("a" * (wire.MAX_NAME + 1), "b"),
            f"layout tensor 0 is {wire.MAX_NAME + 1} characters long; the limit is {wire.MAX_NAME}",
        ),
        (("a", "b\n"), "layout tensor 1 'b\\n' holds non-printable characters"),
        (("a", "a"), "layout columns name a tensor twice; group its pieces in one run"),
    ):
        with pytest.raises(InvalidArgument) as raised:
            wire.layout_from_pb(of_tensors(*tensors))
        assert str(raised.value) == says, tensors


def test_a_layout_of_more_tensors_than_pieces_allowed_is_refused_by_count() -> None:
    names = [f"t{i}" for i in range(wire.MAX_PIECES + 1)]
    wire.layout_from_pb(of_tensors(*names[:-1]))
    with pytest.raises(LimitExceeded) as raised:
        wire.layout_from_pb(of_tensors(*names))
    assert str(raised.value) == (
        f"the layout declares {wire.MAX_PIECES + 1} pieces; the limit is {wire.MAX_PIECES} per rank"
    )


def test_layout_piece_counts_and_dimensions_are_checked_at_their_bounds() -> None:
    """One tensor of 0 dimensions holds pieces with no values: the count alone is checked.
    The piece limit is taken and one past refused; a count past 2^31 is a count, not a
    negative; MAX_DIMS dimensions are taken; no width given is 8 bytes."""

    def pieces(count: int, dims: int = 0, width: int = 0) -> pb.Layout:
        laid = of_tensors("t")
        cols = laid.columns
        cols.dims, cols.counts, cols.width = bytes([dims]), count.to_bytes(4, "little"), width
        values = dims * min(count, wire.MAX_PIECES + 1) * (width or 8)
        cols.shapes = bytes((width or 8) * dims)
        cols.offsets = cols.lengths = bytes(values)
        cols.replicated = bytes(min(count, wire.MAX_PIECES + 1))  # refused by count first
        return laid

    wire.layout_from_pb(pieces(wire.MAX_PIECES))
    for count in (wire.MAX_PIECES + 1, 2**31):
        with pytest.raises(LimitExceeded) as raised:
            wire.layout_from_pb(pieces(count))
        assert str(raised.value) == (
            f"the layout declares {count} pieces; the limit is {wire.MAX_PIECES} per rank"
        )
    wire.layout_from_pb(pieces(1, dims=wire.MAX_DIMS))
    with pytest.raises(LimitExceeded) as deep:
        wire.layout_from_pb(pieces(1, dims=wire.MAX_DIMS + 1))
    assert str(deep.value) == (
        f"a layout tensor has {wire.MAX_DIMS + 1} dimensions; the limit is {wire.MAX_DIMS}"
    )
    assert wire.layout_from_pb(pieces(2, dims=1, width=0)).columns().width == 8


def as_piece_messages(laid: pb.Layout) -> pb.Layout:
    """The same layout as older agents send it: one ShardPiece message per piece."""
    held = wire.layout_from_pb(laid)
    older = pb.Layout()
    older.CopyFrom(laid)
    older.ClearField("columns")
    for p in held.columns():
        older.pieces.append(
            pb.ShardPiece(
                tensor=p.tensor,
                shape=p.shape,
                offset=p.offset,
                length=p.length,
                replicated=p.replicated,
            )
        )
    return older


def test_a_layout_comes_through_the_wire_whole_and_its_axes_are_checked() -> None:
    """Everything a layout declares survives the wire (sizes, position, config, dtype,
    quantization, format, pieces); axes it does not know and sizes out of range are refused,
    naming them; sizes and positions left out are 1 and 0."""
    from cohortgate.coordinator.contract.layout import AXES
    from cohortgate.coordinator.contract.limits import Limits

    sent = (
        layout(5, tp=2, pp=2, dp=2, config={"n_layer": 12}, dtype="bfloat16", quantization="fp8")
        .split("w", (8, 8), 0, 0, 2)
        .build()
    )
    msg = wire.layout_to_pb(sent)
    got = wire.layout_from_pb(msg)
    assert (got.sizes, got.position, got.config, got.dtype, got.quantization, got.format) == (
        sent.sizes,
        sent.position,
        sent.config,
        "bfloat16",
        "fp8",
        sent.format,
    )
    assert got.sizes["tp"] == 2 and got.position != dict.fromkeys(AXES, 0) and got.config
    assert list(got.columns()) == list(sent.columns())
    bare = pb.Layout(sizes={"tp": 2}, position={"tp": 1})
    plain = wire.layout_from_pb(bare)
    assert plain.sizes == {a: 2 if a == "tp" else 1 for a in AXES}
    assert plain.position == {a: 1 if a == "tp" else 0 for a in AXES}
    for table in ("sizes", "position"):
        odd = pb.Layout()
        getattr(odd, table).update({f"z{i}": 1 for i in range(7)})
        with pytest.raises(InvalidArgument) as raised:
            wire.layout_from_pb(odd)
        assert str(raised.value) == (
            f"layout {table} names unknown axes ['z0', 'z1', 'z2', 'z3', 'z4']; use "
            f"{', '.join(AXES)}"
        )
    assert wire.layout_from_pb(pb.Layout(format=7)).format == 7
    both = wire.layout_to_pb(sent)
    both.pieces.append(pb.ShardPiece(tensor="w"))
    with pytest.raises(InvalidArgument) as twice:
        wire.layout_from_pb(both)
    assert str(twice.value) == "the layout sends both pieces and columns; send one of them"
    for field in ("config", "dtype", "quantization"):
        long = pb.Layout()
        setattr(long, field, "x" * (wire.MAX_TEXT + 1))
        with pytest.raises(InvalidArgument) as too_long:
            wire.layout_from_pb(long)
        assert str(too_long.value) == (
            f"layout {field} is {wire.MAX_TEXT + 1} characters long; the limit is {wire.MAX_TEXT}"
        )
    most = Limits().max_world_size
    wire.layout_from_pb(pb.Layout(sizes={"dp": most}))
    for size in (0, most + 1):
        with pytest.raises(InvalidArgument) as out:
            wire.layout_from_pb(pb.Layout(sizes={"dp": size}))
        assert str(out.value) == (
            f"layout sizes {{'dp': {size}}} must each be between 1 and {most}"
        )


def test_pieces_sent_one_message_each_read_as_the_columns_do_and_are_checked() -> None:
    """Older agents send a layout's pieces as messages: the same layout comes out, and each
    piece is checked at its bounds, named by its place and tensor."""
    laid = columns()
    older = as_piece_messages(laid)
    assert len(older.pieces) == 2
    assert list(wire.layout_from_pb(older).columns()) == list(wire.layout_from_pb(laid).columns())

    def refused(
        change: Callable[[pb.ShardPiece], None], error: type[Exception] = InvalidArgument
    ) -> str:
        broken = as_piece_messages(laid)
        change(broken.pieces[1])
        with pytest.raises(error) as raised:
            wire.layout_from_pb(broken)
        return str(raised.value)

    named = "layout piece 1 ('b')"
    assert refused(lambda p: setattr(p, "tensor", "")) == (
        "layout piece 1 ('') tensor is empty; it is required"
    )
    long = "x" * (wire.MAX_NAME + 1)
    assert refused(lambda p: setattr(p, "tensor", long)) == (
        f"layout piece 1 ('{long[:80]}') tensor is {wire.MAX_NAME + 1} characters long; the "
        f"limit is {wire.MAX_NAME}"
    )
    for field in ("shape", "offset", "length"):

        def deeper(p: pb.ShardPiece, field: str = field) -> None:
            getattr(p, field).extend([1] * wire.MAX_DIMS)

        assert refused(deeper, LimitExceeded) == (
            f"{named} has {wire.MAX_DIMS + 1} dimensions; the limit is {wire.MAX_DIMS}"
        )
    for bad in (-1, 2**62):

        def out_of_range(p: pb.ShardPiece, bad: int = bad) -> None:
            p.length[0] = bad

        said = refused(out_of_range)
        assert said == (
            f"{named} has a negative or oversized shape, offset or length ([8], [0], [{bad}]); "
            "each is 0 to 2^62"
        )
    top = as_piece_messages(laid)
    top.pieces[1].shape[0] = 2**62 - 1
    top.pieces[1].length[0] = 2**62 - 1
    wire.layout_from_pb(top)  # the largest extent is taken
    zero = as_piece_messages(laid)
    zero.pieces[1].length[0] = 0
    wire.layout_from_pb(zero)  # and the smallest

    def another_shape(p: pb.ShardPiece) -> None:
        p.tensor, p.shape[0] = "w", 9  # 'w' is declared with another shape by piece 0

    said = refused(another_shape)
    assert said == "layout pieces: tensor 'w' is declared with two logical shapes, [8, 8] and [9]"
    deepest = as_piece_messages(laid)
    d = wire.MAX_DIMS
    deepest.pieces.append(pb.ShardPiece(tensor="d", shape=[1] * d, offset=[0] * d, length=[1] * d))
    wire.layout_from_pb(deepest)  # MAX_DIMS dimensions are taken
    many = pb.Layout()
    many.CopyFrom(older)
    del many.pieces[:]
    many.pieces.extend([older.pieces[0]] * wire.MAX_PIECES)
    wire.layout_from_pb(many)  # as many pieces as the limit are taken
    many.pieces.append(older.pieces[0])
    with pytest.raises(LimitExceeded) as over:
        wire.layout_from_pb(many)
    assert str(over.value) == (
        f"the layout declares {wire.MAX_PIECES + 1} pieces; the limit is {wire.MAX_PIECES} per rank"
    )


@pytest.mark.parametrize(
    ("broken", "code", "says"),
    [
        (
            columns(offsets=b"\0" * 7),
            grpc.StatusCode.INVALID_ARGUMENT,
            "offsets is 7 bytes; 2 pieces of 2 tensors need 12",
        ),
        (
            columns(lengths=b"\xff" * 12),
            grpc.StatusCode.INVALID_ARGUMENT,
            "lengths holds a value outside 0 to 2^62",
        ),
        (
            columns(replicated=b"\x02\x01"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "replicated holds a byte other than 0 or 1",
        ),
        (columns(width=3), grpc.StatusCode.INVALID_ARGUMENT, "width is 3"),
        (columns(dims=b"\x41\x01"), grpc.StatusCode.RESOURCE_EXHAUSTED, "65 dimensions"),
        (columns(counts=b"\0" * 4), grpc.StatusCode.INVALID_ARGUMENT, "8 of counts; got 2 and 4"),
        (
            columns(counts=(200_000).to_bytes(4, "little") + b"\0" * 4),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "200000 pieces; the limit is",
        ),
    ],
)
def test_malformed_columns_are_refused_naming_what_is_wrong(
    coordinator: InProcessCoordinator, broken: pb.Layout, code: grpc.StatusCode, says: str
) -> None:
    m = manifest_of()
    request = join_request("columns", 0, 1, m)
    request.layout.CopyFrom(broken)
    result = run_rank(coordinator.addr, request, m, 5.0)
    assert result.error is not None, result.verdict
    assert result.error.code() == code, result.error.details()
    assert says in (result.error.details() or ""), result.error.details()


def test_a_tensor_named_twice_or_pieces_sent_both_ways_are_refused() -> None:
    twice = columns()
    twice.columns.tensors[1] = "w"
    with pytest.raises(InvalidArgument, match="name a tensor twice"):
        wire.layout_from_pb(twice)
    both = columns()
    both.pieces.add(tensor="x", shape=[1], offset=[0], length=[1])
    with pytest.raises(InvalidArgument, match="both pieces and columns"):
        wire.layout_from_pb(both)


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
