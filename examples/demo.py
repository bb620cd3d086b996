"""The main demo: sign two models and show how cohortgate explains their difference."""

from __future__ import annotations

import sys

import torch
from torch import nn

import agent


def model(hidden: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.GELU(), nn.Linear(hidden, 64)).to(dtype)


def main() -> int:
    reference = agent.manifest(model(256))
    print(f"reference signature {reference.signature_hex()[:16]}  ({len(reference)} tensors)")
    for label, other in (
        ("same model", model(256)),
        ("wider hidden layer", model(512)),
        ("float64 weights (DDP would not notice)", model(256, torch.float64)),
    ):
        m = agent.manifest(other)
        print(f"\n== {label}: signature {m.signature_hex()[:16]}")
        print(agent.diff(reference, m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
