"""A tp x pp x dp job: each position builds a Megatron-style column/row-parallel MLP slice
of its pipeline stage and declares its layout. Launch with tp*pp*dp ranks (default 8).

  --sizes tp=2,pp=2,dp=2  the parallel sizes (default tp=2,pp=2,dp=2; tp=2,dp=2 is 4 ranks)
  --wrong-width-rank R    rank R builds its fc1 slice 8 rows too wide (and says so)
  --duplicate-rank R      rank R claims the position of rank R-1
  --steps N               training steps after the cohort forms (default 0). Every
                          data-parallel replica of a slice gets the same batch, so the
                          replicas of one slice stay bit-identical, as DDP keeps them
  --audit                 call cohort.audit(model, step) after every step: the coordinator
                          compares the replicas of each slice (not all ranks: tp and pp
                          slices hold different weights)
  --flip-rank R --flip-step S
                          after step S rank R flips one bit of one weight
  --step-sleep S          sleep S seconds per step (default 0)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import cohortgate

D, H = 16, 64  # model width, MLP hidden size (split over tp)


class MLPSlice(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, rows)  # column-parallel: a slice of the hidden rows
        self.fc2 = nn.Linear(rows, D)  # row-parallel: the matching slice of its columns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def parse_sizes(text: str) -> dict[str, int]:
    sizes = {}
    for part in text.split(","):
        axis, _, size = part.partition("=")
        sizes[axis.strip()] = int(size)
    return sizes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("tp=2,pp=2,dp=2"))
    parser.add_argument("--wrong-width-rank", type=int, default=-1)
    parser.add_argument("--duplicate-rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--audit", action="store_true")
    parser.add_argument("--flip-rank", type=int, default=-1)
    parser.add_argument("--flip-step", type=int, default=-1)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    return parser.parse_args()


def train(
    args: argparse.Namespace, cohort: cohortgate.Cohort, model: MLPSlice, slice_id: int
) -> int:
    """The same batches for every replica of a slice: its replicas take the same steps."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(slice_id)
    for step in range(args.steps):
        loss = model(torch.randn(8, D, generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if cohort.rank == args.flip_rank and step == args.flip_step:
            with torch.no_grad():
                model.fc1.weight.view(-1).view(torch.int32)[0] ^= 1 << 3
        if args.audit:
            try:
                cohort.audit(model, step)
            except cohortgate.ReplicasDiverged:
                return 5
        time.sleep(args.step_sleep)
    return 0


def main() -> int:
    args = parse_args()
    sizes = args.sizes
    rank = int(os.environ["RANK"])
    claimed = rank - 1 if rank == args.duplicate_rank else rank
    layers = sizes.get("pp", 1)
    decl = cohortgate.layout(claimed, config={"d_model": D, "ffn": H, "layers": layers}, **sizes)
    tp, pp = decl.position["tp"], decl.position["pp"]
    tp_size = sizes.get("tp", 1)
    rows = H // tp_size + (8 if rank == args.wrong_width_rank else 0)
    torch.manual_seed(pp * 10 + tp)
    model = MLPSlice(rows)
    stage = f"layers.{pp}"
    decl.shard(f"{stage}.fc1.weight", (H, D), (tp * (H // tp_size), 0), (rows, D))
    decl.shard(f"{stage}.fc1.bias", (H,), (tp * (H // tp_size),), (rows,))
    decl.shard(f"{stage}.fc2.weight", (D, H), (0, tp * (H // tp_size)), (D, rows))
    decl.replicated(f"{stage}.fc2.bias", (D,))  # row-parallel bias: every tp rank holds it

    try:
        cohort = cohortgate.init_process_group(model, backend="gloo", layout=decl)
    except cohortgate.CohortRefused:
        return 3
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    failed = train(args, cohort, model, slice_id=pp * 10 + tp)
    if failed:
        return failed
    line = (
        f"rank {cohort.rank}: tp={tp} pp={pp} dp={decl.position['dp']} formed "
        f"{cohort.cohort_id}, all_reduce {total.item():g}, trained {args.steps} steps\n"
    )
    sys.stdout.write(line)  # one write: the ranks' lines never interleave
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if total.item() == cohort.world_size else 1


if __name__ == "__main__":
    sys.exit(main())
