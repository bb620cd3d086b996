"""A tp=2 x pp=2 x dp=2 job: each position builds a Megatron-style column/row-parallel MLP
slice of its pipeline stage and declares its layout. Launch with 8 ranks.

  --wrong-width-rank R   rank R builds its fc1 slice 8 rows too wide (and says so)
  --duplicate-rank R     rank R claims the position of rank R-1
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import agent

D, H = 16, 64  # model width, MLP hidden size (split over tp)
SIZES = {"tp": 2, "pp": 2, "dp": 2}


class MLPSlice(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, rows)  # column-parallel: a slice of the hidden rows
        self.fc2 = nn.Linear(rows, D)  # row-parallel: the matching slice of its columns


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wrong-width-rank", type=int, default=-1)
    parser.add_argument("--duplicate-rank", type=int, default=-1)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    claimed = rank - 1 if rank == args.duplicate_rank else rank
    decl = agent.layout(claimed, config={"d_model": D, "ffn": H, "layers": SIZES["pp"]}, **SIZES)
    tp, pp = decl.position["tp"], decl.position["pp"]
    rows = H // SIZES["tp"] + (8 if rank == args.wrong_width_rank else 0)
    torch.manual_seed(pp * 10 + tp)
    model = MLPSlice(rows)
    stage = f"layers.{pp}"
    decl.shard(f"{stage}.fc1.weight", (H, D), (tp * (H // SIZES["tp"]), 0), (rows, D))
    decl.shard(f"{stage}.fc1.bias", (H,), (tp * (H // SIZES["tp"]),), (rows,))
    decl.shard(f"{stage}.fc2.weight", (D, H), (0, tp * (H // SIZES["tp"])), (D, rows))
    decl.replicated(f"{stage}.fc2.bias", (D,))  # row-parallel bias: every tp rank holds it

    try:
        cohort = agent.init_process_group(model, backend="gloo", layout=decl)
    except agent.CohortRefused:
        return 3
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    print(
        f"rank {cohort.rank}: tp={tp} pp={pp} dp={decl.position['dp']} formed "
        f"{cohort.cohort_id}, all_reduce {total.item():g}",
        flush=True,
    )
    dist.destroy_process_group()
    return 0 if total.item() == cohort.world_size else 1


if __name__ == "__main__":
    sys.exit(main())
