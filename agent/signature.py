"""The manifest of a torch.nn.Module: parameters then buffers, read without touching data."""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from coordinator.manifest import Entry, Kind, Manifest, ManifestError

if TYPE_CHECKING:
    import torch

_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    """Canonical dtype spelling ('float32'), never torch's enum number, which is unstable."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = str(dtype).removeprefix("torch.")
        _DTYPE_NAMES[dtype] = name
    return name


def _overrides_walk(module: torch.nn.Module) -> bool:
    """Wrappers that rename their members (FSDP1 and the like) must be asked, not walked."""
    import torch

    base = torch.nn.Module
    cls = type(module)
    return (
        cls.named_parameters is not base.named_parameters
        or cls.named_buffers is not base.named_buffers
        or cls.named_modules is not base.named_modules
    )


def manifest(module: torch.nn.Module) -> Manifest:
    """Every parameter, then every buffer (non-persistent ones too: DDP broadcasts them).

    Reads only metadata (dtype, shape, strides, requires_grad), so it works on CPU, CUDA
    and meta tensors alike and never synchronises a device. A tensor registered under
    several names (tied embeddings, a shared submodule) is listed under each name, the
    later ones marked `alias_of` the first.
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"agent.manifest() takes a torch.nn.Module, not {type(module).__name__}")
    # Building 100k small tuples would otherwise trigger full collections that scan every
    # module object; nothing built here forms a cycle, so the collector has nothing to find.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return Manifest(tuple(_entries(module)))
    finally:
        if gc_was_enabled:
            gc.enable()


def _entries(root: torch.nn.Module) -> list[Entry]:
    """named_parameters(remove_duplicate=False), then named_buffers(...), as entries.

    torch's own walk is a chain of nested generators; this one loop visits the same modules
    in the same pre-order, skipping None members as torch does, at a fraction of the cost.
    That is what keeps the signature near the price of a bare walk at 100k tensors.
    """
    if _overrides_walk(root):
        return _entries_from(
            root.named_parameters(remove_duplicate=False),
            root.named_buffers(remove_duplicate=False),
        )
    params: list[tuple[str, Any]] = []
    buffers: list[tuple[str, Any]] = []
    stack: list[tuple[str, torch.nn.Module]] = [("", root)]
    while stack:
        prefix, module = stack.pop()
        for out, members in ((params, module._parameters), (buffers, module._buffers)):
            if members:
                out.extend([(prefix + key, t) for key, t in members.items() if t is not None])
        if module._modules:
            children = [
                (f"{prefix}{key}.", child)
                for key, child in module._modules.items()
                if child is not None
            ]
            children.reverse()
            stack.extend(children)
    return _entries_from(params, buffers)


def _entries_from(
    params: Iterable[tuple[str, Any]], buffers: Iterable[tuple[str, Any]]
) -> list[Entry]:
    first_name: dict[int, str] = {}
    entries: list[Entry] = []
    append = entries.append
    names = _DTYPE_NAMES
    for kind, members in ((Kind.PARAMETER, params), (Kind.BUFFER, buffers)):
        is_param = kind is Kind.PARAMETER
        for name, tensor in members:
            key = id(tensor)
            alias = first_name.get(key)
            if alias is None:
                first_name[key] = name
            try:
                dtype = tensor.dtype
                append(
                    Entry(
                        kind,
                        name,
                        names.get(dtype) or _dtype_name(dtype),
                        tuple(tensor.shape),
                        is_param and tensor.requires_grad,
                        alias,
                        None if tensor.is_contiguous() else tuple(tensor.stride()),
                    )
                )
            except Exception as exc:
                raise ManifestError(
                    f"cannot sign {kind.value} '{name}' ({type(tensor).__name__}): "
                    f"{type(exc).__name__}: {exc}. cohortgate reads only dtype, shape, strides "
                    "and requires_grad; make them readable or register the tensor differently."
                ) from exc
    return entries
