"""DTensor parameters declare their own pieces: global shape, placements, local piece."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cohortgate.coordinator.contract.layout import ShardPiece

if TYPE_CHECKING:
    import torch


def dtensor_pieces(
    model: torch.nn.Module, skip: set[str] | frozenset[str] = frozenset()
) -> list[ShardPiece]:
    """A piece for every DTensor parameter and buffer of `model` (names as in its manifest),
    from its global shape and placements; all-Replicate tensors are declared replicated.
    Tensors named in `skip` (declared by hand) are left alone."""
    try:
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # a torch built without distributed
        return []
    pieces = []
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in named:
        if name in skip or not isinstance(tensor, DTensor):
            continue
        shape = tuple(int(s) for s in tensor.shape)
        if all(isinstance(p, Replicate) for p in tensor.placements):
            pieces.append(ShardPiece(name, shape, (0,) * len(shape), shape, replicated=True))
            continue
        local, offset = compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements
        )
        pieces.append(
            ShardPiece(name, shape, tuple(int(o) for o in offset), tuple(int(n) for n in local))
        )
    return pieces
