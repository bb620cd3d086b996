"""Extraction of the manifest from real torch.nn modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import cohortgate
from cohortgate.coordinator.contract.manifest import Kind, ManifestError
from tests.helpers import python_c
from tests.models import TinyTransformer, tiny


def test_parameters_then_buffers_in_declaration_order() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    m = cohortgate.manifest(model)
    assert [(e.kind, e.name) for e in m.entries] == [
        (Kind.PARAMETER, "0.weight"),
        (Kind.PARAMETER, "0.bias"),
        (Kind.PARAMETER, "1.weight"),
        (Kind.PARAMETER, "1.bias"),
        (Kind.PARAMETER, "2.weight"),
        (Kind.PARAMETER, "2.bias"),
        (Kind.BUFFER, "1.running_mean"),
        (Kind.BUFFER, "1.running_var"),
        (Kind.BUFFER, "1.num_batches_tracked"),
    ]
    assert m.entries[0].shape == (8, 4)
    assert m.entries[0].dtype == "float32"
    assert m.entries[-1].dtype == "int64"


def test_matches_torch_named_parameters_and_buffers_exactly() -> None:
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared, tiny())
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    assert [e.name for e in cohortgate.manifest(model).entries] == names


def test_tied_weights_are_marked_as_aliases() -> None:
    m = cohortgate.manifest(tiny(tie=True))
    head = next(e for e in m.entries if e.name == "head.weight")
    assert head.alias_of == "embed.weight"
    untied = cohortgate.manifest(tiny(tie=False))
    assert next(e for e in untied.entries if e.name == "head.weight").alias_of is None
    assert m.signature() != untied.signature()


def test_frozen_parameters_and_none_members() -> None:
    model = nn.Linear(4, 4, bias=False)  # registers bias as None: skipped, as torch does
    model.weight.requires_grad_(False)
    (entry,) = cohortgate.manifest(model).entries
    assert entry.name == "weight"
    assert entry.requires_grad is False


def test_non_persistent_buffers_are_included() -> None:
    model = nn.Module()
    model.register_buffer("kept", torch.zeros(2))
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    assert [e.name for e in cohortgate.manifest(model).entries] == ["kept", "scratch"]


def test_channels_last_records_strides() -> None:
    conv = nn.Conv2d(3, 8, 3)
    plain = cohortgate.manifest(conv)
    assert plain.entries[0].strides is None
    conv.weight.data = conv.weight.data.to(memory_format=torch.channels_last)
    cl = cohortgate.manifest(conv)
    assert cl.entries[0].strides == tuple(conv.weight.stride())
    assert cl.signature() != plain.signature()


def test_meta_and_cpu_builds_sign_identically() -> None:
    cpu = TinyTransformer()
    with torch.device("meta"):
        meta = TinyTransformer()
    assert next(meta.parameters()).is_meta
    assert cohortgate.manifest(meta).signature() == cohortgate.manifest(cpu).signature()


def test_dtype_names_are_canonical() -> None:
    model = nn.Module()
    model.a = nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    model.b = nn.Parameter(torch.zeros(2, dtype=torch.float8_e4m3fn), requires_grad=False)
    assert [e.dtype for e in cohortgate.manifest(model).entries] == ["bfloat16", "float8_e4m3fn"]


@pytest.mark.slow
def test_same_model_same_signature_in_two_processes() -> None:
    code = (
        "import cohortgate; from tests.models import tiny;"
        "print(cohortgate.manifest(tiny()).signature().hex())"
    )
    outs = [python_c(code, timeout=120) for _ in range(2)]
    assert outs[0] == outs[1] == cohortgate.manifest(tiny()).signature_hex()


class UnreadableShape(torch.Tensor):
    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        raise RuntimeError("shape is data-dependent")


def test_unsignable_tensor_names_the_entry_and_reason() -> None:
    model = nn.Module()
    model.register_buffer("ok", torch.zeros(1))
    model.register_buffer("odd", torch.zeros(2).as_subclass(UnreadableShape))
    with pytest.raises(ManifestError, match=r"buffer 'odd'.*shape is data-dependent"):
        cohortgate.manifest(model)


def test_wrappers_that_rename_members_are_asked() -> None:
    class Prefixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def named_parameters(
            self, *args: object, **kwargs: object
        ) -> Iterator[tuple[str, nn.Parameter]]:
            for name, p in self.inner.named_parameters():
                yield f"renamed.{name}", p

    assert [e.name for e in cohortgate.manifest(Prefixed()).entries] == [
        "renamed.weight",
        "renamed.bias",
    ]


def test_not_a_module_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        cohortgate.manifest(torch.zeros(1))  # type: ignore[arg-type]


def test_the_agent_client_loads_no_decision_state_or_service() -> None:
    # A rank loads the contract and the codec, never the coordinator's core.
    code = (
        "import sys, cohortgate, cohortgate.agent.client;"
        "core = tuple('cohortgate.coordinator.' + m for m in"
        " ('decision', 'state', 'service', 'edge', 'cli')) + ('numpy',);"
        "print(','.join(sorted(m for m in sys.modules if m.startswith(core))))"
    )
    assert python_c(code) == ""


def test_importing_cohortgate_imports_nothing_heavy() -> None:
    code = (
        "import sys, cohortgate;"
        "heavy = [m for m in ('torch', 'grpc', 'google.protobuf', 'numpy') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    assert python_c(code) == ""


# CUDA joins the list wherever it is present (the GPU machine); CPU and meta always run.
DEVICES = ["cpu", "meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_every_device_signs_like_the_cpu(device: str) -> None:
    with torch.device(device):
        model = TinyTransformer()
    assert next(model.parameters()).device.type == device
    assert cohortgate.manifest(model).signature() == cohortgate.manifest(tiny()).signature()


def test_dtensor_parameters_declare_their_pieces() -> None:
    """On a one-rank gloo mesh (a DTensor needs a process group): the sharded parameter
    covers the whole tensor from offset 0, the replicated one is declared replicated."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Module()
        model.w = nn.Parameter(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]))
        model.b = nn.Parameter(distribute_tensor(torch.zeros(4), mesh, [Replicate()]))
        model.plain = nn.Parameter(torch.zeros(2))
        pieces = {p.tensor: p for p in cohortgate.dtensor_pieces(model)}
    finally:
        dist.destroy_process_group()
    assert set(pieces) == {"w", "b"}
    assert (pieces["w"].shape, pieces["w"].offset, pieces["w"].length) == ((8, 4), (0, 0), (8, 4))
    assert not pieces["w"].replicated and pieces["b"].replicated
