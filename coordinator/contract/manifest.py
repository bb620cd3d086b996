"""The model manifest, its canonical encoding and its SHA-256 signature (torch-free)."""

from __future__ import annotations

import enum
import functools
import hashlib
import pickle
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

# Bumped whenever the canonical encoding changes. It is the first thing hashed, so
# manifests encoded under different formats can never produce equal signatures.
MANIFEST_FORMAT_VERSION = 1
_HEADER = f"cohortgate.manifest.v{MANIFEST_FORMAT_VERSION}\n"

# Canonical dtype spelling: torch's own name without the "torch." prefix
# ("float32", "bfloat16", "float8_e4m3fn"). Anything outside this alphabet is rejected
# so the encoding stays unambiguous without escaping.
_DTYPE_RE = re.compile(r"[a-z][a-z0-9_]{0,63}")


class ManifestError(ValueError):
    """A manifest (or a module being turned into one) that cannot be signed."""


class Kind(enum.StrEnum):
    PARAMETER = "parameter"
    BUFFER = "buffer"


_KIND_TAG = {Kind.PARAMETER: "P", Kind.BUFFER: "B"}


class Entry(NamedTuple):
    """One tensor as a rank registered it: what the collectives address by position.

    A NamedTuple rather than a frozen dataclass: building 100k of them must cost
    little next to torch's own module walk.
    """

    kind: Kind
    name: str
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool = False
    alias_of: str | None = None
    strides: tuple[int, ...] | None = None

    def describe(self, *, with_name: bool = True) -> str:
        """`'fc.weight' float32[4096, 1024]`, plus whatever else sets the entry apart."""
        text = f"{self.dtype}{list(self.shape)}"
        if with_name:
            text = f"'{self.name}' {text}"
        extras = []
        if self.kind is Kind.BUFFER:
            extras.append("buffer")
        elif not self.requires_grad:
            extras.append("frozen")
        if self.alias_of is not None:
            extras.append(f"tied to '{self.alias_of}'")
        if self.strides is not None:
            extras.append(f"strides {list(self.strides)}")
        return f"{text} ({', '.join(extras)})" if extras else text

    def encode(self) -> str:
        """The entry's canonical text: every field delimited or length-prefixed."""
        alias = "-" if self.alias_of is None else f"a{len(self.alias_of)}:{self.alias_of}"
        strides = "-" if self.strides is None else repr(self.strides)
        grad = "g" if self.requires_grad else "-"
        return (
            f"{_KIND_TAG[self.kind]}{len(self.name)}:{self.name}"
            f";{self.dtype};{self.shape!r};{grad};{alias};{strides}\n"
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": self.kind.value,
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
        }
        if self.kind is Kind.PARAMETER:
            out["requires_grad"] = self.requires_grad
        if self.alias_of is not None:
            out["alias_of"] = self.alias_of
        if self.strides is not None:
            out["strides"] = list(self.strides)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Entry:
        try:
            kind = Kind(data["kind"])
            strides = data.get("strides")
            entry = Entry(
                kind=kind,
                name=data["name"],
                dtype=data["dtype"],
                shape=tuple(data["shape"]),
                requires_grad=bool(data.get("requires_grad", False)),
                alias_of=data.get("alias_of"),
                strides=None if strides is None else tuple(strides),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ManifestError(f"malformed manifest entry {dict(data)!r}: {exc}") from exc
        entry.validate()
        return entry

    def validate(self) -> None:
        """Raise ManifestError naming the entry if any field is outside the encoding's domain."""
        where = f"{self.kind.value} '{self.name}'" if isinstance(self.name, str) else "entry"
        if not isinstance(self.name, str) or not self.name:
            raise ManifestError(f"{where}: name must be a non-empty string")
        if not isinstance(self.dtype, str) or not _DTYPE_RE.fullmatch(self.dtype):
            raise ManifestError(
                f"{where}: dtype {self.dtype!r} is not a canonical dtype name "
                "(lower-case, like 'float32' or 'bfloat16')"
            )
        for label, dims in (("shape", self.shape), ("strides", self.strides)):
            if dims is None:
                continue
            if not all(type(d) is int for d in dims):
                raise ManifestError(f"{where}: {label} {dims!r} must hold integers")
        if any(d < 0 for d in self.shape):
            raise ManifestError(f"{where}: shape {list(self.shape)} has a negative dimension")
        if self.strides is not None and len(self.strides) != len(self.shape):
            raise ManifestError(
                f"{where}: strides {list(self.strides)} do not match shape {list(self.shape)}"
            )
        if self.kind is Kind.BUFFER and self.requires_grad:
            raise ManifestError(f"{where}: a buffer cannot require grad")
        if self.alias_of is not None and (not isinstance(self.alias_of, str) or not self.alias_of):
            raise ManifestError(f"{where}: alias_of must be a non-empty name")


@dataclass(frozen=True)
class Manifest:
    """Parameters then buffers, in declaration order: order is identity."""

    entries: tuple[Entry, ...]

    @classmethod
    def of(cls, entries: Iterable[Entry]) -> Manifest:
        """Build and validate: parameters before buffers, names unique, aliases resolvable."""
        manifest = cls(tuple(entries))
        manifest.validate()
        return manifest

    def validate(self) -> None:
        seen: set[str] = set()
        in_buffers = False
        for position, entry in enumerate(self.entries):
            entry.validate()
            if entry.kind is Kind.BUFFER:
                in_buffers = True
            elif in_buffers:
                raise ManifestError(
                    f"parameter '{entry.name}' at position {position} follows a buffer: "
                    "a manifest lists every parameter before any buffer"
                )
            if entry.name in seen:
                raise ManifestError(f"name '{entry.name}' appears twice in the manifest")
            if entry.alias_of is not None and entry.alias_of not in seen:
                raise ManifestError(
                    f"{entry.kind.value} '{entry.name}' is tied to '{entry.alias_of}', "
                    "which does not come before it in the manifest"
                )
            seen.add(entry.name)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def parameters(self) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if e.kind is Kind.PARAMETER)

    @property
    def buffers(self) -> tuple[Entry, ...]:
        return tuple(e for e in self.entries if e.kind is Kind.BUFFER)

    def encode(self) -> bytes:
        """Canonical bytes: a format header, then one length-prefixed record per entry."""
        return (_HEADER + "".join([e.encode() for e in self.entries])).encode("utf-8")

    @functools.cached_property
    def _digest(self) -> bytes:
        return hashlib.sha256(self.encode()).digest()

    def signature(self) -> bytes:
        """The 32-byte SHA-256 of the canonical encoding (computed once; `.hex()` to print)."""
        return self._digest

    def signature_hex(self) -> str:
        return self.signature().hex()

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT_VERSION,
            "entries": [e.to_dict() for e in self.entries],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        version = data.get("format")
        if version != MANIFEST_FORMAT_VERSION:
            raise ManifestError(
                f"manifest format {version!r} is not the format this side reads "
                f"({MANIFEST_FORMAT_VERSION}); upgrade the older of agent and coordinator"
            )
        raw = data.get("entries")
        if not isinstance(raw, Sequence):
            raise ManifestError("manifest has no 'entries' list")
        return cls.of(Entry.from_dict(item) for item in raw)


class HeldManifest:
    """A verified manifest as the coordinator holds it while its cohort forms: its entries
    pickled and compressed (~10 bytes an entry instead of ~500 as objects), decoded each
    time `entries` is read (a diff, the weights check). Never built from network bytes:
    only from a Manifest already decoded and validated."""

    __slots__ = ("_blob", "_length", "_signature")

    def __init__(self, manifest: Manifest) -> None:
        self._blob = zlib.compress(pickle.dumps(manifest.entries, protocol=5), 1)
        self._length = len(manifest)
        self._signature = manifest.signature()

    @property
    def entries(self) -> tuple[Entry, ...]:
        entries: tuple[Entry, ...] = pickle.loads(zlib.decompress(self._blob))
        return entries

    def __len__(self) -> int:
        return self._length

    def signature(self) -> bytes:
        return self._signature


# What the decision reads from a manifest: a Manifest or a HeldManifest.
ManifestLike = Manifest | HeldManifest
