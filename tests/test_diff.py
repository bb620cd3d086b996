"""Manifest diffs on realistic pairs of torch models: each rendering names the right entries."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import cohortgate
from cohortgate.coordinator.contract.diff import LIST_CAP
from cohortgate.coordinator.contract.manifest import Entry, Kind, Manifest
from tests.models import Block, tiny


def test_identical_models_give_an_empty_diff() -> None:
    d = cohortgate.diff(cohortgate.manifest(tiny()), cohortgate.manifest(tiny()))
    assert not d
    assert str(d) == "manifests are identical"


def test_one_layer_hidden_size_changed() -> None:
    d = cohortgate.diff(
        cohortgate.manifest(tiny()), cohortgate.manifest(tiny(hidden_overrides={1: 48}))
    )
    assert d
    text = str(d)
    assert text.splitlines()[0] == (
        "first difference at position 17: 'layers.1.fc1.weight' float32[32, 16] vs float32[48, 16]"
    )
    assert [c.name for c in d.shape_changed] == [
        "layers.1.fc1.weight",
        "layers.1.fc1.bias",
        "layers.1.fc2.weight",
    ]
    assert "'layers.1.fc2.weight': float32[16, 32] -> float32[16, 48]" in text
    assert not d.missing and not d.extra and not d.dtype_changed


def test_one_layer_extra() -> None:
    d = cohortgate.diff(cohortgate.manifest(tiny(layers=3)), cohortgate.manifest(tiny(layers=4)))
    assert [e.name for e in d.extra] == [
        f"layers.3.{m}.{p}"
        for m in ("attn", "proj", "norm", "fc1", "fc2")
        for p in ("weight", "bias")
    ]
    assert not d.missing
    text = str(d)
    assert "extra (here, not in the reference): 10" in text
    assert "first difference at position 31: 'head.weight'" in text
    assert "vs 'layers.3.attn.weight' float32[48, 16]" in text


def test_one_block_in_bfloat16() -> None:
    other = tiny()
    other.layers[2].to(torch.bfloat16)
    d = cohortgate.diff(cohortgate.manifest(tiny()), cohortgate.manifest(other))
    assert {c.name for c in d.dtype_changed} == {
        f"layers.2.{m}.{p}"
        for m in ("attn", "proj", "norm", "fc1", "fc2")
        for p in ("weight", "bias")
    }
    assert "'layers.2.attn.weight': float32[48, 16] -> bfloat16[48, 16]" in str(d)
    assert str(d).startswith("first difference at position 21: 'layers.2.attn.weight' float32")


def test_two_same_shaped_layers_swapped() -> None:
    class Pair(nn.Module):
        def __init__(self, swap: bool) -> None:
            super().__init__()
            order = ("left", "right") if not swap else ("right", "left")
            for name in order:
                self.add_module(name, nn.Linear(8, 8))

    d = cohortgate.diff(cohortgate.manifest(Pair(False)), cohortgate.manifest(Pair(True)))
    assert d
    assert not d.missing and not d.extra and not d.shape_changed
    (order,) = d.order_changed
    assert (order.position, order.reference_name, order.other_name) == (
        0,
        "left.weight",
        "right.weight",
    )
    assert "parameters in another order: at parameter position 0" in str(d)


def test_embeddings_tied_vs_untied() -> None:
    d = cohortgate.diff(cohortgate.manifest(tiny(tie=True)), cohortgate.manifest(tiny(tie=False)))
    (change,) = d.tying_changed
    assert change.name == "head.weight"
    assert "'head.weight': float32[100, 16] (tied to 'embed.weight') -> float32[100, 16]" in str(d)


def test_batchnorm_vs_layernorm_buffers_appear() -> None:
    d = cohortgate.diff(cohortgate.manifest(tiny()), cohortgate.manifest(tiny(norm="batch")))
    extra = [e.name for e in d.extra]
    assert "layers.0.norm.running_mean" in extra
    assert "layers.2.norm.num_batches_tracked" in extra
    assert len(extra) == 9
    assert "'layers.0.norm.running_var' float32[16] (buffer)" in str(d)


def test_kind_and_requires_grad_changes() -> None:
    ref = nn.Module()
    ref.scale = nn.Parameter(torch.ones(4))
    ref.w = nn.Parameter(torch.ones(2))
    other = nn.Module()
    other.w = nn.Parameter(torch.ones(2), requires_grad=False)
    other.register_buffer("scale", torch.ones(4))
    d = cohortgate.diff(cohortgate.manifest(ref), cohortgate.manifest(other))
    assert [c.name for c in d.kind_changed] == ["scale"]
    assert [c.name for c in d.requires_grad_changed] == ["w"]
    assert "kind changed (parameter vs buffer): 1" in str(d)


def test_lists_are_capped() -> None:
    ref = Manifest.of(Entry(Kind.PARAMETER, f"p{i}", "float32", (2,), True) for i in range(50))
    other = Manifest.of(Entry(Kind.PARAMETER, f"p{i}", "float16", (2,), True) for i in range(50))
    d = cohortgate.diff(ref, other)
    text = str(d)
    assert len(d.dtype_changed) == 50
    assert f"and {50 - LIST_CAP} more" in text
    assert text.count("-> float16[2]") == LIST_CAP
    # as a verdict stores it: LIST_CAP of each list, the counts kept, read back the same
    import json

    from cohortgate.coordinator.contract.diff import ManifestDiff

    kept = ManifestDiff.from_dict(json.loads(json.dumps(d.capped().to_dict())))
    assert len(kept.dtype_changed) == LIST_CAP and kept.count("dtype_changed") == 50
    assert str(kept) == text


def test_to_dict_is_json_ready() -> None:
    import json

    d = cohortgate.diff(cohortgate.manifest(Block(4, 8)), cohortgate.manifest(Block(4, 9)))
    data = json.loads(json.dumps(d.to_dict()))
    assert data["first_difference"]["position"] == 6
    assert [c["name"] for c in data["shape_changed"]] == ["fc1.weight", "fc1.bias", "fc2.weight"]


def _entries(*names: str) -> Manifest:
    return Manifest.of(Entry(Kind.PARAMETER, n, "float32", (2,), True) for n in names)


@pytest.mark.parametrize(
    ("reference", "other"),
    [
        (("a", "b", "c"), ("a", "b", "c")),  # no first difference
        (("a", "b", "c"), ("a", "c", "b")),  # the order changed
        (("a", "b"), ("a", "b", "c")),  # past the reference's end: no reference entry
        (("a", "b", "c"), ("a", "b")),  # past the other's end: no other entry
    ],
    ids=["same", "order", "added", "removed"],
)
def test_a_diff_is_stored_and_read_back_whole(
    reference: tuple[str, ...], other: tuple[str, ...]
) -> None:
    """What the history keeps of a refusal's diff (its JSON) reads back as the same diff."""
    import json

    from cohortgate.coordinator.contract.diff import ManifestDiff

    d = cohortgate.diff(_entries(*reference), _entries(*other))
    assert ManifestDiff.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    if reference == ("a", "b", "c") and other == ("a", "c", "b"):
        # the first displaced position of each namespace
        assert d.to_dict()["order_changed"] == [
            {"kind": "parameter", "position": 1, "reference_name": "b", "other_name": "c"}
        ]
