"""Small torch models for the tests: a toy transformer and its mutated variants."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d_model: int, hidden: int, norm: str = "layer") -> None:
        super().__init__()
        self.attn = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm: nn.Module = nn.LayerNorm(d_model) if norm == "layer" else nn.BatchNorm1d(d_model)
        self.fc1 = nn.Linear(d_model, hidden)
        self.fc2 = nn.Linear(hidden, d_model)


class TinyTransformer(nn.Module):
    def __init__(
        self,
        vocab: int = 100,
        d_model: int = 16,
        hidden: int = 32,
        layers: int = 3,
        tie: bool = True,
        hidden_overrides: dict[int, int] | None = None,
        norm: str = "layer",
    ) -> None:
        super().__init__()
        overrides = hidden_overrides or {}
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            Block(d_model, overrides.get(i, hidden), norm) for i in range(layers)
        )
        self.head = nn.Linear(d_model, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def tiny(**kwargs: object) -> TinyTransformer:
    torch.manual_seed(0)
    return TinyTransformer(**kwargs)  # type: ignore[arg-type]
