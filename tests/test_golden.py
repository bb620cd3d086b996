"""Golden vectors: the canonical encodings are the same on every machine and every torch
version, so the values themselves are pinned. A change here breaks every deployed agent's
agreement with its coordinator: bump the format version (manifest, digest, fingerprint) on
purpose, never by accident."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cohortgate.agent.digest import tensor_digest
from cohortgate.agent.signature import manifest
from cohortgate.coordinator.contract.digests import combine, combine_uploaded, differing
from cohortgate.coordinator.contract.errors import InvalidArgument
from cohortgate.coordinator.contract.fingerprint import config_fields, digest, fields_of
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest


def test_a_manifest_signature_is_pinned() -> None:
    m = Manifest.of(
        [
            Entry(Kind.PARAMETER, "fc.weight", "float32", (4, 8), True),
            Entry(Kind.PARAMETER, "fc.bias", "float32", (4,), True),
            Entry(Kind.BUFFER, "steps", "int64", ()),
        ]
    )
    assert m.signature_hex() == "8e481859b405d4c873dcc45377928a5cdd5c306a7e79c8762015ad054559278f"


def test_a_module_signature_is_pinned() -> None:
    assert (
        manifest(nn.Linear(8, 4)).signature_hex()
        == "584a610458224ee1130a3f0dadac7c68312d643345f11923c2fc3bf5ad5bc1b1"
    )


def test_weight_digests_are_pinned_with_and_without_the_kernel() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    golden = "713a9a82a62055b843665a30ea0a05f46813f9f98de9dc0bf2e46aa75ff4e22a"
    assert tensor_digest("w", t, kernel=False).hex() == golden
    assert tensor_digest("w", t, kernel=True).hex() == golden
    assert (
        combine([("a", b"\0" * 32), ("b", b"\1" * 32)]).hex()
        == "43cf0f6c5e3e316557975391ed86456da73482887df34079d4a406532032e754"
    )


def test_a_config_fingerprint_is_pinned() -> None:
    fields = config_fields({"n_head": 4, "rope": {"theta": 1e4}, "_name_or_path": "x"})
    assert fields == {"n_head": "4", "rope.theta": "10000.0"}
    assert (
        digest(fields_of(fields))
        == "c9d191a20905bd6b4467d599b6383fbbd66a949d8e006307271358e6f0dd710a"
    )


def test_the_code_checks_files_field_is_pinned() -> None:
    """`files_field` is what a rank's join carries and an UploadFiles answer is checked
    against: its count, its wording and its hash over (path length, path, digest) in path
    order are part of the wire."""
    from cohortgate.coordinator.contract.digests import files_field

    two = [("train.py", b"\x01" * 32), ("models/gpt.py", b"\x02" * 32)]
    assert files_field(two) == "2 files sha256:2778d2504ab3a041"
    assert files_field(reversed(two)) == files_field(two)  # path order, not the caller's
    assert files_field(two[:1]) == "1 file sha256:04e798c956c63ef0"
    assert files_field([]) == "0 files sha256:6e193e15cf776bd7"


class _SlowTokenizer:
    """What a slow (pure Python) Hugging Face tokenizer shows the fingerprint."""

    def __init__(self, vocab: dict[str, int], added: dict[str, int]) -> None:
        self.vocab, self.added = vocab, added
        self.special_tokens_map = {"unk_token": "<unk>", "additional_special_tokens": ["<t>"]}

    def get_vocab(self) -> dict[str, int]:
        return {**self.vocab, **self.added}

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self.added)


def test_a_tokenizer_fingerprint_is_pinned() -> None:
    """Format cohortgate.tokenizer.v1 (agent/identity.TOKENIZER_FORMAT, hashed in)."""
    from cohortgate import tokenizer_fingerprint

    tok = _SlowTokenizer({"<unk>": 0, "hello": 1, "world": 2}, {"<t>": 3})
    assert tokenizer_fingerprint(tok) == (
        "sha256:543f6a5141633b13f896928ce60664b7b5d2be216bb8d764a84a2cf9364e54e0"
    )


def test_uploaded_digests_combine_as_the_agents_and_a_bad_upload_is_named() -> None:
    """What the coordinator combines from an upload is what the agent combined: the pinned
    value above; a digest of another size, and counts that do not pair, are refused."""
    names, digests = ["a", "b"], [b"\0" * 32, b"\1" * 32]
    assert combine_uploaded(iter(names), digests) == combine(zip(names, digests, strict=True))
    assert combine_uploaded(names, digests).hex() == (
        "43cf0f6c5e3e316557975391ed86456da73482887df34079d4a406532032e754"
    )
    with pytest.raises(InvalidArgument) as raised:
        combine_uploaded(names, [b"\0" * 32, b"\1" * 31])
    assert str(raised.value) == "digests[1] is 31 bytes; each digest is 32"
    with pytest.raises(ValueError, match="zip"):
        combine_uploaded(["a"], digests)  # never a prefix of the upload
    assert differing(names, digests, [b"\0" * 32, b"\2" * 32]) == ["b"]
    with pytest.raises(ValueError, match="zip"):
        differing(names, digests, digests[:1])


def test_a_layout_config_fingerprint_is_pinned() -> None:
    """Sorted keys, compact JSON, metadata keys left out, other values by their text."""
    import decimal
    import hashlib

    from cohortgate.coordinator.contract.layout import config_fingerprint

    config = {"b": 1, "a": [1, 2], "_name_or_path": "x", "lr": decimal.Decimal("1.5")}
    assert config_fingerprint(config) == hashlib.sha256(b'{"a":[1,2],"b":1,"lr":"1.5"}').hexdigest()


def test_an_fsdp_flat_shard_is_one_piece_of_the_padded_flat_tensor() -> None:
    from cohortgate.coordinator.contract.layout import LayoutBuilder, ShardPiece

    built = LayoutBuilder({}, {}).flat("w", 10, 6, 6, padding=2).flat("v", 4, 0, 4).build()
    assert built.pieces == (ShardPiece("w", (12,), (6,), (6,)), ShardPiece("v", (4,), (0,), (4,)))
