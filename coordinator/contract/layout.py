"""Parallel layouts (torch-free): sizes, a rank's shard position, and the pieces it holds."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from array import array
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, overload

LAYOUT_FORMAT_VERSION = 1
AXES = ("tp", "cp", "ep", "dp", "pp")
# Megatron-LM's default rank order: tp varies fastest, then cp, ep, dp, and pp slowest.
MEGATRON_ORDER = "tp-cp-ep-dp-pp"
# Keys of a Hugging Face config that say where it came from, not what the model is.
CONFIG_METADATA_KEYS = frozenset(
    {"_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation_autoset"}
)


def config_fingerprint(config: Mapping[str, Any]) -> str:
    """SHA-256 of the canonical JSON of a model config (e.g. a Hugging Face config's
    `to_dict()`), without metadata keys: two ranks with equal fingerprints build one model."""
    clean = {k: v for k, v in config.items() if k not in CONFIG_METADATA_KEYS}
    text = json.dumps(clean, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def parse_order(order: str) -> tuple[str, ...]:
    axes = tuple(a.strip() for a in order.split("-") if a.strip())
    unknown = [a for a in axes if a not in AXES]
    if unknown or len(set(axes)) != len(axes):
        raise ValueError(
            f"rank order {order!r} must name each of {', '.join(AXES)} at most once, "
            f"fastest-varying first (e.g. {MEGATRON_ORDER!r})"
        )
    return axes + tuple(a for a in AXES if a not in axes)


def position_from_rank(
    rank: int, sizes: Mapping[str, int], order: str = MEGATRON_ORDER
) -> dict[str, int]:
    """The shard position of `rank` when ranks are laid out in `order` (first axis fastest)."""
    position = {}
    rest = rank
    for axis in parse_order(order):
        size = int(sizes.get(axis, 1))
        rest, position[axis] = divmod(rest, size)
    if rest:
        raise ValueError(
            f"rank {rank} is beyond the mesh {dict(sizes)} ({math.prod(sizes.values())} ranks)"
        )
    return position


class ShardPiece(NamedTuple):
    """The part of logical tensor `tensor` (of logical `shape`) that this rank holds, as a
    box; `replicated` pieces are held identically by several ranks of one replica. A tuple
    of atoms, not a dataclass: the garbage collector stops tracking it, so a coordinator
    holding a million pieces does not walk them on every collection (each walk held the
    GIL and stalled the event loop)."""

    tensor: str
    shape: tuple[int, ...]
    offset: tuple[int, ...]
    length: tuple[int, ...]
    replicated: bool = False


# array typecodes of the widths PieceColumns values come in (both sizes on every platform
# CPython supports)
WIDTHS = {4: "i", 8: "q"}


def le_array(typecode: str, data: bytes = b"") -> array[int]:
    """Little-endian bytes (the wire's columns) as an array of native integers."""
    values = array(typecode, data)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def le_bytes(values: array[int]) -> bytes:
    if sys.byteorder == "big":
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


@dataclass(frozen=True)
class PieceColumns:
    """A rank's pieces as columns (the wire's PieceColumns), grouped by tensor: each tensor
    once with its logical shape and how many of its pieces follow, then every piece's box
    as little-endian integers of `width` bytes. A million pieces are a handful of objects,
    read by the coordinator as arrays (decision.pieces) and pickled to a worker as bytes.
    Iterating yields ShardPieces, for small layouts and tests."""

    tensors: tuple[str, ...] = ()
    dims: bytes = b""  # per tensor, one byte
    shapes: bytes = b""  # per tensor, dims values
    counts: bytes = b""  # per tensor, uint32 LE
    offsets: bytes = b""  # per piece, its tensor's dims values
    lengths: bytes = b""
    replicated: bytes = b""  # per piece, 0 or 1
    width: int = 8  # bytes per value of shapes, offsets and lengths (LE): 4 or 8

    @property
    def typecode(self) -> str:
        return WIDTHS[self.width]

    @classmethod
    def of(cls, pieces: Iterable[ShardPiece]) -> PieceColumns:
        """Group pieces by tensor (in first-seen order). Every piece of a tensor must give
        the same logical shape, and as many offsets and lengths as it has dimensions."""
        by_tensor: dict[str, list[ShardPiece]] = {}
        for p in pieces:
            by_tensor.setdefault(p.tensor, []).append(p)
        shapes, counts = array("q"), array("I")
        offsets, lengths, replicated = array("q"), array("q"), bytearray()
        dims = bytearray()
        for tensor, held in by_tensor.items():
            shape = held[0].shape
            for p in held:
                if p.shape != shape:
                    raise ValueError(
                        f"tensor '{tensor[:80]}' is declared with two logical shapes, "
                        f"{list(shape)} and {list(p.shape)}"
                    )
                if len(p.offset) != len(shape) or len(p.length) != len(shape):
                    raise ValueError(
                        f"a piece of '{tensor[:80]}' has {len(p.offset)} offsets and "
                        f"{len(p.length)} lengths for a tensor of {len(shape)} dimensions "
                        f"({list(shape)})"
                    )
                offsets.extend(p.offset)
                lengths.extend(p.length)
                replicated.append(1 if p.replicated else 0)
            if len(shape) > 255:
                raise ValueError(f"tensor '{tensor[:80]}' has {len(shape)} dimensions")
            dims.append(len(shape))
            shapes.extend(shape)
            counts.append(len(held))
        # 4 bytes a value when every value fits (nearly always): half the bytes on the wire
        if all(
            min(c, default=0) >= -(2**31) and max(c, default=0) < 2**31
            for c in (shapes, offsets, lengths)
        ):
            shapes, offsets, lengths = (array("i", c) for c in (shapes, offsets, lengths))
        return cls(
            tuple(by_tensor),
            bytes(dims),
            le_bytes(shapes),
            le_bytes(counts),
            le_bytes(offsets),
            le_bytes(lengths),
            bytes(replicated),
            shapes.itemsize,
        )

    def __len__(self) -> int:
        return len(self.replicated)

    def __iter__(self) -> Iterator[ShardPiece]:
        code = self.typecode
        shapes, counts = le_array(code, self.shapes), le_array("I", self.counts)
        offsets, lengths = le_array(code, self.offsets), le_array(code, self.lengths)
        at = value = piece = 0
        for tensor, d, count in zip(self.tensors, self.dims, counts, strict=True):
            shape = tuple(shapes[at : at + d])
            at += d
            for _ in range(count):
                yield ShardPiece(
                    tensor,
                    shape,
                    tuple(offsets[value : value + d]),
                    tuple(lengths[value : value + d]),
                    bool(self.replicated[piece]),
                )
                value += d
                piece += 1

    @overload
    def __getitem__(self, index: int) -> ShardPiece: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[ShardPiece, ...]: ...
    def __getitem__(self, index: int | slice) -> ShardPiece | tuple[ShardPiece, ...]:
        return tuple(self)[index]


@dataclass(frozen=True)
class Layout:
    """What a rank declares about its place in a sharded job."""

    sizes: dict[str, int]
    position: dict[str, int]
    config: str = ""  # config_fingerprint() of the model config, if the user passed one
    dtype: str = ""  # e.g. "bfloat16 params, float32 grads"
    quantization: str = ""
    pieces: tuple[ShardPiece, ...] | PieceColumns = ()
    format: int = LAYOUT_FORMAT_VERSION

    def columns(self) -> PieceColumns:
        """The pieces as columns (what the wire and the coverage check read)."""
        pieces = self.pieces
        return pieces if isinstance(pieces, PieceColumns) else PieceColumns.of(pieces)

    def size(self, axis: str) -> int:
        return int(self.sizes.get(axis, 1))

    @property
    def replica_key(self) -> tuple[int, ...]:
        """The position without its dp coordinate: ranks sharing it must be identical."""
        return tuple(self.position.get(a, 0) for a in AXES if a != "dp")

    @property
    def replica_label(self) -> str:
        """The replica group as reports name it: "tp=1 pp=0 ..." (every axis but dp)."""
        return " ".join(f"{a}={self.position.get(a, 0)}" for a in AXES if a != "dp")

    @property
    def position_key(self) -> tuple[int, ...]:
        return tuple(self.position.get(a, 0) for a in AXES)


@dataclass
class LayoutBuilder:
    """agent-side helper: `layout(tp=2, pp=2, dp=2).shard(...).replicated(...)`."""

    sizes: dict[str, int]
    position: dict[str, int]
    config: str = ""
    dtype: str = ""
    quantization: str = ""
    pieces: list[ShardPiece] = field(default_factory=list)

    def shard(
        self, tensor: str, shape: tuple[int, ...], offset: tuple[int, ...], length: tuple[int, ...]
    ) -> LayoutBuilder:
        self.pieces.append(ShardPiece(tensor, tuple(shape), tuple(offset), tuple(length)))
        return self

    def split(
        self, tensor: str, shape: tuple[int, ...], dim: int, index: int, parts: int
    ) -> LayoutBuilder:
        """Piece `index` of `parts` equal slices of `tensor` along `dim` (TP column/row)."""
        if shape[dim] % parts:
            raise ValueError(
                f"{tensor}: dimension {dim} ({shape[dim]}) is not divisible by {parts}"
            )
        step = shape[dim] // parts
        offset = tuple(index * step if d == dim else 0 for d in range(len(shape)))
        length = tuple(step if d == dim else s for d, s in enumerate(shape))
        return self.shard(tensor, shape, offset, length)

    def replicated(self, tensor: str, shape: tuple[int, ...]) -> LayoutBuilder:
        self.pieces.append(
            ShardPiece(tensor, tuple(shape), (0,) * len(shape), tuple(shape), replicated=True)
        )
        return self

    def flat(
        self, tensor: str, numel: int, offset: int, length: int, padding: int = 0
    ) -> LayoutBuilder:
        """An FSDP-style flat shard of a flattened tensor of `numel` elements plus `padding`."""
        self.pieces.append(ShardPiece(tensor, (numel + padding,), (offset,), (length,)))
        return self

    def build(self) -> Layout:
        return Layout(
            dict(self.sizes),
            dict(self.position),
            self.config,
            self.dtype,
            self.quantization,
            tuple(self.pieces),
        )


def layout(
    rank: int,
    *,
    order: str = MEGATRON_ORDER,
    position: Mapping[str, int] | None = None,
    config: Mapping[str, Any] | None = None,
    dtype: str = "",
    quantization: str = "",
    **sizes: int,
) -> LayoutBuilder:
    """Declare a layout: sizes by axis (tp=2, pp=2, dp=2, ...), the position derived from the
    rank and a named rank order unless given, a config to fingerprint."""
    unknown = [a for a in sizes if a not in AXES]
    if unknown:
        raise ValueError(f"unknown parallel axes {unknown}; use {', '.join(AXES)}")
    pos = dict(position) if position is not None else position_from_rank(rank, sizes, order)
    return LayoutBuilder(
        sizes={a: int(sizes.get(a, 1)) for a in AXES},
        position={a: int(pos.get(a, 0)) for a in AXES},
        config=config_fingerprint(config) if config is not None else "",
        dtype=dtype,
        quantization=quantization,
    )
