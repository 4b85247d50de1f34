"""One rank of a two-process tensor-parallel run (run by tests/test_tensor_parallel.py; not a test module).

    python tests/peers/tp_peer.py MODEL_DIR ADAPTER_DIR OUT    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Loads the model sharded across the two ranks, generates seeded completions, trains two steps on them (several
packed rows per step: gradient accumulation), generates again from the updated shards, and saves what it saw; then
the same with the optimizer state in host memory (optim.placement=host), saving its parameters and norms. Then,
unless ADAPTER_DIR is "", the same once more with the LoRA adapters saved there (each rank takes its slice of the
sharded ones; tests/test_lora_tensor_parallel.py checks it): one launch for both tests, as each launch costs two
interpreters importing torch and transformers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

from unison.dist import tensor_parallel
from unison.dist.tensor_parallel import LocalForward, full_state_dict, replicated_agree
from unison.dist.topology import init_topology
from unison.engine import Engine, EngineConfig, SamplingParams
from unison.lora import LoraConfig, save_adapter
from unison.models import load_policy
from unison.rollout.advantage import group_advantages
from unison.rollout.sample import Sample
from unison.train.loss import LossConfig
from unison.train.optimizer import OptimConfig, build_optimizer
from unison.train.step import train_step

STEPS, GROUP = 2, 4
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0)
LORA = LoraConfig(r=4, alpha=8)


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


def saved_adapters(model_dir: str, folder) -> str:
    """The tiny Qwen3's adapters with ``lora_B`` random (as after training, so that they matter), in PEFT's format."""
    model, _ = load_policy(model_dir, dtype=torch.float32, lora=LORA)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    os.makedirs(folder)
    save_adapter(model, LORA, str(folder), model_dir)
    return str(folder)


@contextlib.contextmanager
def training_switches():
    """Counts the linears the training forwards and backwards switch to their local shards (the list's length)."""
    switches, training_linear = [], tensor_parallel._training_linear
    tensor_parallel._training_linear = lambda module, style: switches.append(style) or training_linear(module, style)
    try:
        yield switches
    finally:
        tensor_parallel._training_linear = training_linear


def plain_run(model_dir: str, topology) -> dict:
    model, _ = load_policy(model_dir, dtype=torch.float32, topology=topology)
    with training_switches() as switches:
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
    return result


def lora_run(model_dir: str, adapter_dir: str, topology) -> dict:
    """As ``plain_run`` with the adapters in ``adapter_dir``: the tokens and logprobs, the whole state dict loaded and
    after training (gathered), the replicated parameters, the sharded ones' names, how many linears the local
    forwards switched."""
    model, _ = load_policy(model_dir, dtype=torch.float32, topology=topology, lora=LORA, adapter=adapter_dir)
    result = {"loaded": {k: v.clone() for k, v in full_state_dict(model).items()}}  # before training
    with training_switches() as switches:
        result.update(run(model, lambda m: build_optimizer(m, OPTIM, STEPS, topology), topology))
    result["training_switches"] = len(switches)
    with LocalForward(model)() as switched:
        result["switched"] = switched
    replicated_agree(model, topology.tp)
    result["params"] = full_state_dict(model)
    result["replicated"] = {n: p.detach().clone() for n, p in model.named_parameters()
                            if not hasattr(p, "placements")}
    result["sharded"] = sorted(n for n, p in model.named_parameters() if hasattr(p, "placements"))
    return result


def main():
    model_dir, adapter_dir, out = sys.argv[1:]
    topology = init_topology(2, 120.0, "cpu")
    result = {"plain": plain_run(model_dir, topology)}
    if adapter_dir:
        result["lora"] = lora_run(model_dir, adapter_dir, topology)
    torch.save(result, os.path.join(out, f"rank{topology.tp.rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
