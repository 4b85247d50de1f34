"""Tensor parallelism's engine-vs-trainer logprob difference with bf16 and with fp32 partial sums.

    python bench/soak.py --make-checkpoint /tmp/soak --shape qwen3-1.7b
    torchrun --nproc-per-node 2 bench/tp_rounding.py /tmp/soak --json tp_rounding.json
    python bench/soak.py --make-checkpoint /tmp/tiny --shape tiny --device cpu && \\
        torchrun --nproc-per-node 2 bench/tp_rounding.py /tmp/tiny --device cpu            # the CPU version

A row-wise projection's output under tp=2 is the sum of two partial products. Summed as bf16 (what DTensor's
Partial placement does, and unison did until the tp=2 difference measured ~7% above one GPU's on two H200s), each
partial is rounded, then their sum: three roundings, which the engine's and the trainer's kernels place
differently. ``unison.dist.tensor_parallel.rowwise_reduce`` sums them in fp32 and rounds once, as one process
does. This runs the same prompts through the whole model (one process) and through its two shards with either
reduction, in bf16, and reports the mean |engine - trainer| logprob difference per completion token (the
``mismatch/logprob_diff_mean`` metric), the trainer being the whole model or the shards.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from unison.dist import tensor_parallel
from unison.dist.tensor_parallel import local_forward
from unison.dist.topology import Topology, init_topology
from unison.engine import Engine, EngineConfig, SamplingParams
from unison.models import load_policy
from unison.rollout.sample import Sample
from unison.train.logprobs import policy_logprobs
from unison.train.packing import pack_samples

GROUP = 8


def bf16_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """In place of ``tensor_parallel._fp32_product``: the partial product rounded to bf16 before the all-reduce."""
    return x @ weight.T


def generate(model, prompts: list[list[int]], new: int, topology: Topology | None = None) -> list[Sample]:
    engine = Engine(model, EngineConfig(num_blocks=len(prompts) * GROUP * (-(-(len(prompts[0]) + new) // 16) + 1),
                                        block_size=16, max_num_seqs=len(prompts) * GROUP, seed=0), topology=topology)
    done = engine.generate(prompts, SamplingParams(max_new_tokens=new, n=GROUP, seed=7, stop_token_ids=()))
    return [Sample(tuple(c.prompt_ids), tuple(c.token_ids), tuple(c.logprobs), tuple(c.weight_versions), 0.0, 0.0)
            for c in done]


@torch.no_grad()
def mean_diff(model, samples: list[Sample], topology: Topology | None = None) -> float:
    """Mean |trainer logprob - engine logprob| over every completion token (the ``mismatch/logprob_diff_mean``
    metric), the trainer's packed forward on ``model``."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    with local_forward(model, topology)(train=True):  # shards: as train_step runs them
        for row in pack_samples(samples, 8192, 0):
            row = row.to(device)
            logprobs, _ = policy_logprobs(model, row)
            total += (logprobs - row.engine_logprobs[row.loss_mask]).abs().sum().item()
            count += logprobs.numel()
    return total / count


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    topology = init_topology(2, 600.0, args.device)
    device = str(topology.device)
    whole, _ = load_policy(args.checkpoint, dtype=torch.bfloat16, device=device)
    shards, _ = load_policy(args.checkpoint, dtype=torch.bfloat16, device=device, topology=topology)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, whole.config.vocab_size, (args.prompt_tokens,), generator=g).tolist()
               for _ in range(args.prompts)]
    one = generate(whole, prompts, args.new)
    result = {"device": args.device, "samples": len(one), "new_tokens": args.new,
              "one_process": mean_diff(whole, one)}
    fp32_product = tensor_parallel._fp32_product
    for name, product in (("tp2_bf16_partials", bf16_product), ("tp2_fp32_partials", fp32_product)):
        tensor_parallel._fp32_product = product  # the engine's and the trainer's row-wise projections alike
        samples = generate(shards, prompts, args.new, topology)
        result[name] = {"tp_trainer": mean_diff(shards, samples, topology),
                        "whole_model_trainer": mean_diff(whole, samples)}
    tensor_parallel._fp32_product = fp32_product
    if topology.is_main:
        print(json.dumps(result, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
