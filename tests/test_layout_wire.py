"""A layout on the wire (codec/wire.py): what it declares comes through whole, as columns (what
agents send) or one message per piece (older agents), and every column, piece, name, count
and axis is checked at its bounds, each error whole. Fast and in `make mutation`'s
selection: hostile input stops here."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest

from cohortgate.coordinator.api.v1 import cohort_pb2 as pb
from cohortgate.coordinator.codec import wire
from cohortgate.coordinator.contract.errors import InvalidArgument, LimitExceeded
from cohortgate.coordinator.contract.layout import Layout, PieceColumns, ShardPiece, layout
from tests.helpers import InProcessCoordinator, join_request, manifest_of, run_rank


@pytest.fixture(scope="module")
def coordinator() -> Iterator[InProcessCoordinator]:
    c = InProcessCoordinator(join_deadline=30.0)
    yield c
    c.stop()


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
