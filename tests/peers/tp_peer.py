"""One rank of a two-process tensor-parallel run (run by tests/test_tensor_parallel.py; not a test module).

    python tests/peers/tp_peer.py MODEL_DIR OUT        (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment)

Loads the model sharded across the two ranks, generates seeded completions, trains two steps on them (several
packed rows per step: gradient accumulation), generates again from the updated shards, and saves what it saw; then
the same with the optimizer state in host memory (optim.placement=host), saving its parameters and norms.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from unison.dist import tensor_parallel
from unison.dist.tensor_parallel import LocalForward, full_state_dict
from unison.dist.topology import init_topology
from unison.engine import Engine, EngineConfig, SamplingParams
from unison.models import load_policy
from unison.rollout.advantage import group_advantages
from unison.rollout.sample import Sample
from unison.train.loss import LossConfig
from unison.train.optimizer import OptimConfig, build_optimizer
from unison.train.step import train_step

STEPS, GROUP = 2, 4
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)


def run(model, optimizer_for, topology=None) -> dict:
    """Generate, train STEPS steps, generate again; the same on one process and on each tensor-parallel rank."""
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=8, seed=0, cuda_graphs=False), topology=topology)
    prompts = [[5, 9, 14, 3, 77], [100, 4, 8], [31, 32, 33, 34, 35, 36]]
    params = SamplingParams(max_new_tokens=10, n=GROUP, seed=5, stop_token_ids=())
    before = engine.generate(prompts, params)
    samples = []
    for k in range(0, len(before), GROUP):
        rewards = [float((k + i) % 3) for i in range(GROUP)]
        samples += [Sample(tuple(c.prompt_ids), tuple(c.token_ids), tuple(c.logprobs), tuple(c.weight_versions), r, a)
                    for c, r, a in zip(before[k:k + GROUP], rewards, group_advantages(rewards), strict=True)]
    optimizer = optimizer_for(model)
    norms = []
    for _ in range(STEPS):
        metrics = train_step(model, optimizer, samples, LossConfig(), 1.0, 40, 0, 16,  # 40 tokens: several rows
                             topology=topology)
        norms.append(metrics["optim/grad_norm"])
        engine.weights_updated(engine.version + 1)
    after = engine.generate(prompts, params)
    return {"tokens": [c.token_ids for c in before], "logprobs": [c.logprobs for c in before], "norms": norms,
            "tokens_after": [c.token_ids for c in after], "logprobs_after": [c.logprobs for c in after]}


def main():
    model_dir, out = sys.argv[1:]
    topology = init_topology(2, 120.0, "cpu")
    tp = topology.tp
    model, _ = load_policy(model_dir, dtype=torch.float32, topology=topology)
    switches, training_linear = [], tensor_parallel._training_linear
    tensor_parallel._training_linear = lambda module, style: switches.append(style) or training_linear(module, style)
    result = run(model, lambda m: build_optimizer(m, OPTIM, STEPS, topology), topology)
    result["training_switches"] = len(switches)
    q_proj = model.model.layers[0].self_attn.q_proj
    with LocalForward(model)() as switched:  # what the engine's forwards ran under
        result["local_forward"] = {"switched": switched, "hooks_inside": len(q_proj._forward_pre_hooks)}
    result["local_forward"]["hooks_after"] = len(q_proj._forward_pre_hooks)
    result["params"] = full_state_dict(model)
    result["replicated"] = {n: p.detach().clone() for n, p in model.named_parameters()
                            if not hasattr(p, "placements")}
    host_model, _ = load_policy(model_dir, dtype=torch.float32, topology=topology)
    host = run(host_model, lambda m: build_optimizer(m, dataclasses.replace(OPTIM, placement="host"), STEPS, topology),
               topology)
    result["host"] = {"params": full_state_dict(host_model), "norms": host["norms"]}
    torch.save(result, os.path.join(out, f"rank{tp.rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
