"""A tiny Hugging Face model gated by cohortgate: every rank builds the same GPT-2 (or Llama)
from a config, unless a flag makes one rank differ where the parameter shapes stay equal,
which only the `config` and `facts` checks see.

  --model gpt2|llama     (default gpt2)
  --vary-rank R          the rank that differs (default: none)
  --vary FIELD=VALUE     what differs on it: a config field (n_head=2, rope_theta=500000.0,
                         _name_or_path=elsewhere) or a fact (fact.data=mix-v4)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch.distributed as dist

import cohortgate


def build(kind: str, overrides: dict[str, object]):  # type: ignore[no-untyped-def]
    import transformers

    if kind == "llama":
        llama = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 128,
        }
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**llama, **overrides}))
    gpt2 = {
        "n_layer": 2,
        "n_head": 4,
        "n_embd": 64,
        "vocab_size": 128,
        "n_positions": 32,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**gpt2, **overrides}))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--vary-rank", type=int, default=-1)
    parser.add_argument("--vary", default="", help="FIELD=VALUE (default: nothing)")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    overrides: dict[str, object] = {}
    facts: dict[str, object] = {"data": "mix-v3", "resume_step": 1200}
    if rank == args.vary_rank and args.vary:
        field, _, value = args.vary.partition("=")
        parsed = json.loads(value) if value[:1].isdigit() else value
        if field.startswith("fact."):
            facts[field[len("fact.") :]] = parsed
        else:
            overrides[field] = parsed
    model = build(args.model, overrides)
    try:
        cohort = cohortgate.init_process_group(model, backend="gloo", facts=facts)
    except cohortgate.CohortRefused:
        return 3
    dist.barrier()
    sys.stdout.write(f"rank {rank}/{cohort.world_size}: cohort {cohort.cohort_id} formed\n")
    sys.stdout.flush()  # one write: the ranks' lines never interleave
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
