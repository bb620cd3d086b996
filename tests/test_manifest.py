"""The torch-free manifest: canonical encoding, signature properties, serialisation, validation."""

from __future__ import annotations

import json

import pytest

from cohortgate.coordinator.contract.manifest import (
    MANIFEST_FORMAT_VERSION,
    Entry,
    Kind,
    Manifest,
    ManifestError,
)
from tests.helpers import python_c

P, B = Kind.PARAMETER, Kind.BUFFER


def param(
    name: str, shape: tuple[int, ...] = (3, 2), dtype: str = "float32", **kw: object
) -> Entry:
    return Entry(P, name, dtype, shape, requires_grad=kw.pop("requires_grad", True), **kw)  # type: ignore[arg-type]


def buf(name: str, shape: tuple[int, ...] = (2,), dtype: str = "float32") -> Entry:
    return Entry(B, name, dtype, shape)


BASE = [param("w"), param("b", (2,)), buf("rm")]


def sig(entries: list[Entry]) -> bytes:
    return Manifest.of(entries).signature()


def test_signature_is_32_bytes_and_stable() -> None:
    s = sig(BASE)
    assert len(s) == 32
    assert s == sig(list(BASE))
    assert Manifest.of(BASE).signature_hex() == s.hex()


@pytest.mark.parametrize(
    ("label", "changed"),
    [
        ("name", [param("w2"), param("b", (2,)), buf("rm")]),
        ("dtype", [param("w", dtype="bfloat16"), param("b", (2,)), buf("rm")]),
        ("shape", [param("w", (2, 3)), param("b", (2,)), buf("rm")]),
        ("rank of shape", [param("w", (6,)), param("b", (2,)), buf("rm")]),
        ("order", [param("b", (2,)), param("w"), buf("rm")]),
        ("kind", [param("w"), param("b", (2,)), param("rm", (2,))]),
        ("requires_grad", [param("w", requires_grad=False), param("b", (2,)), buf("rm")]),
        ("strides", [param("w", strides=(1, 3)), param("b", (2,)), buf("rm")]),
        ("extra entry", [*BASE, buf("extra")]),
    ],
)
def test_each_field_changes_the_signature(label: str, changed: list[Entry]) -> None:
    assert sig(changed) != sig(BASE), label


def test_tying_changes_the_signature() -> None:
    untied = [param("embed"), param("head")]
    tied = [param("embed"), param("head", alias_of="embed")]
    assert sig(untied) != sig(tied)


def test_names_are_delimited() -> None:
    assert sig([param("ab"), param("c")]) != sig([param("a"), param("bc")])
    assert sig([param("a;float32"), param("x")]) != sig([param("a"), param("x")])


def test_parameters_and_buffers_are_separate_namespaces() -> None:
    assert sig([param("x", (2,), requires_grad=False)]) != sig([buf("x")])


def test_encoding_begins_with_the_format_version() -> None:
    encoded = Manifest.of(BASE).encode()
    assert encoded.startswith(f"cohortgate.manifest.v{MANIFEST_FORMAT_VERSION}\n".encode())


def test_round_trip_through_json_hashes_identically() -> None:
    entries = [
        param("embed", (10, 4)),
        param("frozen", (4,), requires_grad=False),
        param("head", (10, 4), alias_of="embed"),
        param("conv", (8, 3, 3, 3), strides=(27, 1, 9, 3)),
        buf("count", (), dtype="int64"),
    ]
    original = Manifest.of(entries)
    wire = json.dumps(original.to_dict())
    rebuilt = Manifest.from_dict(json.loads(wire))
    assert rebuilt == original
    assert rebuilt.encode() == original.encode()
    assert rebuilt.signature() == original.signature()


def test_signature_is_the_same_in_another_process() -> None:
    code = (
        "from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest;"
        "print(Manifest.of([Entry(Kind.PARAMETER, 'w', 'float32', (3, 2), True),"
        "Entry(Kind.BUFFER, 'rm', 'float32', (2,))]).signature_hex())"
    )
    here = Manifest.of([param("w"), buf("rm")]).signature_hex()
    assert python_c(code) == here


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([param("w", dtype="torch.float32")], "not a canonical dtype"),
        ([param("w", dtype="")], "not a canonical dtype"),
        ([param("")], "non-empty"),
        ([param("w", (-1, 2))], "negative dimension"),
        ([param("w", strides=(1,))], "do not match shape"),
        ([param("w"), param("w")], "appears twice"),
        ([param("head", alias_of="embed"), param("embed")], "does not come before"),
        ([buf("rm"), param("w")], "follows a buffer"),
    ],
)
def test_invalid_manifests_are_refused_with_the_reason(entries: list[Entry], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        Manifest.of(entries)


def test_from_dict_refuses_other_formats_and_garbage() -> None:
    with pytest.raises(ManifestError, match="format 99"):
        Manifest.from_dict({"format": 99, "entries": []})
    with pytest.raises(ManifestError) as raised:
        Manifest.from_dict({"format": MANIFEST_FORMAT_VERSION})
    assert str(raised.value) == "manifest has no 'entries' list"
    with pytest.raises(ManifestError, match="malformed manifest entry"):
        Manifest.from_dict({"format": MANIFEST_FORMAT_VERSION, "entries": [{"kind": "param"}]})
    with pytest.raises(ManifestError, match="must hold integers"):
        Manifest.from_dict(
            {
                "format": MANIFEST_FORMAT_VERSION,
                "entries": [{"kind": "buffer", "name": "x", "dtype": "int64", "shape": [True]}],
            }
        )


def test_coordinator_manifest_does_not_import_torch() -> None:
    code = (
        "import sys, cohortgate.coordinator.contract.manifest,"
        " cohortgate.coordinator.contract.diff;"
        "print('torch' in sys.modules)"
    )
    assert python_c(code) == "False"


def test_an_entry_is_described_with_what_sets_it_apart_and_stored_whole() -> None:
    frozen = Entry(Kind.PARAMETER, "w", "float32", (2, 3), False, strides=(1, 2))
    assert frozen.describe() == "'w' float32[2, 3] (frozen, strides [1, 2])"
    assert frozen.to_dict()["strides"] == [1, 2]
    assert Entry.from_dict(frozen.to_dict()) == frozen
    tied = Entry(Kind.PARAMETER, "h", "float32", (2, 3), True, alias_of="w")
    assert tied.describe(with_name=False) == "float32[2, 3] (tied to 'w')"
    assert "strides" not in tied.to_dict()
