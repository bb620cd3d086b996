"""A small DDP training job gated by cohortgate. Launch with torchrun or `cohortgate run`.

Flags make chosen ranks build a different model, to show a refusal:
  --wide-rank R     rank R builds a wider hidden layer
  --wide-node N     every rank of node N (torchrun's GROUP_RANK) builds a wider hidden layer
  --float64-rank R  rank R holds one block in float64 (DDP itself would not notice)
  --absent-rank R   rank R never joins (the coordinator's deadline names it)
  --seed-rank R     rank R initialises its weights from another seed (needs
                    --verify-values and a coordinator with --policy weights=strict)
  --verify-values   send a digest of the weights' values too
  --resume-rank R   rank R declares another resume step (facts={"resume_step": ...}): the
                    shapes agree, the facts check does not
  --audit           call cohort.audit(model, step) after every step (replicas compared
                    during training); --audit-optimizer digests the optimizer state too
  --flip-rank R --flip-step S
                    after step S, rank R flips one bit of one weight (a silent data
                    corruption): the next audit names rank R, its host, the tensor, the step
  --step-sleep S    sleep S seconds per step (a slower step, as real training has)
  --quiet           no line per step; rank 0 still prints the mean step time and, with
                    --audit, the time the training thread spent in cohort.audit()
  --crash-rank R    rank R exits 1 right after its cohort formed, in torchrun's first
                    attempt only (TORCHELASTIC_RESTART_COUNT 0): with --max-restarts, torchrun
                    restarts every worker and the next round forms
  --no-close        (with --audit) skip cohort.close() at the end: the agent's exit hook
                    has the last word (a strict divergence still exits non-zero, code 5)
  --hang-rank R --hang-step S
                    at step S rank R enters wait_for_batch(), which sleeps for an hour, while
                    the others go on into the next collective: a hung job (every step calls
                    cohort.step(step); the coordinator's --stall-after names the stall)
  --stop-rank R --stop-step S
                    at step S rank R stops itself (SIGSTOP: a frozen process, as a hung host's)
  --odd-call-rank R --odd-call-step S
                    at step S rank R calls broadcast where the others call all_reduce
  --pause-step S --pause-s X
                    at step S every rank pauses X seconds on purpose (a checkpoint save,
                    inside `with cohort.pause("checkpoint"):`)
  --hold-rank R --hold-file F
                    rank R (the flag repeats) joins only once file F exists: a job with some
                    ranks in and the others still to come (the failover tests hold it so)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import TextIO

import torch
import torch.distributed as dist
from torch import nn

import cohortgate


def say(line: str, stream: TextIO = sys.stdout) -> None:
    """One whole line in one write: the ranks share the terminal, and print() writes the
    text and its newline apart, so two ranks' lines could interleave."""
    stream.write(line + "\n")
    stream.flush()


def build_model(hidden: int, float64_block: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(32, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, 1)
    )
    if float64_block:
        model[2].to(torch.float64)
    return model


def flip_bit(weight: torch.Tensor) -> None:
    """One bit of one element, as a faulty GPU or memory would flip it (bit 3 of the
    mantissa: the value barely moves, training goes on, the loss does not tell)."""
    with torch.no_grad():
        weight.view(-1).view(torch.int32)[0] ^= 1 << 3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--steps", type=int, default=5, help="DDP steps (default 5)")
    add("--hidden", type=int, default=64, help="hidden width (default 64)")
    add("--wide-rank", type=int, default=-1, help="rank R builds a wider hidden layer")
    add("--wide-node", type=int, default=-1, help="every rank of node N builds a wider layer")
    add("--float64-rank", type=int, default=-1, help="rank R holds one block in float64")
    add("--absent-rank", type=int, default=-1, help="rank R never joins")
    add("--seed-rank", type=int, default=-1, help="rank R initialises from another seed")
    add("--verify-values", action="store_true", help="send a digest of the weights' values")
    add("--resume-rank", type=int, default=-1, help="rank R declares another resume step")
    add("--hold-rank", type=int, action="append", default=[], help="rank R waits for --hold-file")
    add("--hold-file", default="", help="the file the --hold-rank ranks wait for")
    add("--audit", action="store_true", help="cohort.audit(model, step) after every step")
    add("--audit-optimizer", action="store_true", help="with --audit: the optimizer state too")
    add("--flip-rank", type=int, default=-1, help="rank R flips one bit after --flip-step")
    add("--flip-step", type=int, default=-1, help="the step after which --flip-rank flips")
    add("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (default 0)")
    add("--quiet", action="store_true", help="no line per step")
    add("--hang-rank", type=int, default=-1, help="rank R hangs at --hang-step (an hour)")
    add("--hang-step", type=int, default=-1, help="the step --hang-rank hangs at")
    add("--stop-rank", type=int, default=-1, help="rank R SIGSTOPs itself at --stop-step")
    add("--stop-step", type=int, default=-1, help="the step --stop-rank stops at")
    add("--odd-call-rank", type=int, default=-1, help="rank R calls broadcast at --odd-call-step")
    add("--odd-call-step", type=int, default=-1, help="the step --odd-call-rank goes astray at")
    add("--pause-step", type=int, default=-1, help="every rank pauses at step S (on purpose)")
    add("--pause-s", type=float, default=5.0, help="seconds of --pause-step's pause (default 5)")
    add("--crash-rank", type=int, default=-1, help="rank R exits 1 after forming, first try only")
    add(
        "--no-close",
        action="store_true",
        help="skip cohort.close() at the end: the agent's exit hook has the last word",
    )
    return parser.parse_args()


def wait_for_batch() -> None:
    """--hang-rank: the rank waits here while the others go on into the next collective."""
    time.sleep(3600)  # a data loader that never delivers


def astray(args: argparse.Namespace, cohort: cohortgate.Cohort, step: int) -> None:
    """What the flags make a step do besides training: --hang-rank hangs, --odd-call-rank
    broadcasts where the others all-reduce (a diverged branch), --pause-step pauses."""
    if cohort.rank == args.hang_rank and step == args.hang_step:
        wait_for_batch()
    if cohort.rank == args.stop_rank and step == args.stop_step:
        os.kill(os.getpid(), signal.SIGSTOP)
    if step == args.odd_call_step:
        t = torch.zeros(1)
        if cohort.rank == args.odd_call_rank:
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t)
    if step == args.pause_step:
        with cohort.pause("checkpoint"):
            time.sleep(args.pause_s)


def train(args: argparse.Namespace, cohort: cohortgate.Cohort, model: nn.Module) -> int:
    """DDP steps; with --audit each step's weights are compared across the replicas."""
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(cohort.rank)
    stepping = auditing = 0.0  # seconds in the steps (without --step-sleep), in audit()
    for step in range(args.steps):
        try:
            cohort.step(step)  # a counter; the agent reports it (stalls are named)
        except cohortgate.CohortStalled:
            return 6  # said on stderr and in torchrun's error file (--policy stall=strict)
        astray(args, cohort, step)
        started = time.perf_counter()
        x = torch.randn(16, 32, generator=gen)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if cohort.rank == args.flip_rank and step == args.flip_step:
            flip_bit(model[2].weight)
        if args.audit:
            audit_at = time.perf_counter()
            try:
                cohort.audit(model, step, optimizer=opt if args.audit_optimizer else None)
            except cohortgate.ReplicasDiverged:
                return 5  # said on stderr and in torchrun's error file (--policy audit=strict)
            auditing += time.perf_counter() - audit_at
        stepping += time.perf_counter() - started
        if cohort.rank == 0 and not args.quiet:
            say(f"step {step}: loss {loss.item():.4f}")
        time.sleep(args.step_sleep)
    if args.audit and not args.no_close:
        try:  # the audits in flight compared: a divergence found as the job ends stops it
            cohort.close()
        except cohortgate.ReplicasDiverged:
            return 5
    if cohort.rank == 0 and args.steps:
        audit = (
            f", of which cohort.audit {1e3 * auditing / args.steps:.3f} ms" if args.audit else ""
        )
        mean = 1e3 * stepping / args.steps
        say(f"rank 0: step time {mean:.3f} ms{audit} (mean of {args.steps} steps)")
    return 0


def main() -> int:
    args = parse_args()
    rank = int(os.environ["RANK"])
    if rank == args.absent_rank:
        time.sleep(3600)  # alive but never joins: torchrun ends it once the others fail
        return 0
    while rank in args.hold_rank and not os.path.exists(args.hold_file):
        time.sleep(0.05)
    node = int(os.environ.get("GROUP_RANK", "0"))
    wide = rank == args.wide_rank or node == args.wide_node
    hidden = args.hidden * 2 if wide else args.hidden
    model = build_model(
        hidden, float64_block=rank == args.float64_rank, seed=1 if rank == args.seed_rank else 0
    )

    try:
        facts = {"data": "demo-mix-v3", "resume_step": 1100 if rank == args.resume_rank else 1200}
        cohort = cohortgate.init_process_group(
            model, backend="gloo", verify_values=args.verify_values, facts=facts
        )
    except cohortgate.CohortRefused:
        return 3  # the report is already on stderr and in torchrun's error file
    except cohortgate.CohortgateError as exc:  # a setting, an unreachable coordinator: one line
        say(f"rank {rank}: cohortgate: {exc}", sys.stderr)
        return 4

    if rank == args.crash_rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        say(f"rank {rank}: crashing after cohort {cohort.cohort_id} formed (first attempt)")
        os._exit(1)
    # The cohort's own endpoint carries the collectives: check it sums correctly.
    total = torch.tensor([float(cohort.rank + 1)])
    dist.all_reduce(total)
    expected = cohort.world_size * (cohort.world_size + 1) / 2
    if total.item() != expected:
        say(f"rank {cohort.rank}: all_reduce gave {total.item()}, expected {expected}")
        return 1

    failed = train(args, cohort, model)
    if failed:
        return failed
    say(
        f"rank {cohort.rank}/{cohort.world_size}: cohort {cohort.cohort_id} formed, "
        f"all_reduce sum {total.item():g}, trained {args.steps} steps"
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
