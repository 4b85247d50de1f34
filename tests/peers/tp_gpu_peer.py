"""One rank of a two-GPU tensor-parallel engine check (run by tests/test_tensor_parallel_gpu.py; not a test module).

    python tests/peers/tp_gpu_peer.py MODEL_DIR OUT    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment)

An fp32 model sharded over two GPUs decodes through CUDA graphs that hold the row-wise projections' NCCL
all-reduces; its logprobs are compared with a teacher-forced forward of the whole model on this GPU, before and
after an update of the shards in place (the graphs read the parameters at their addresses).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest and the test modules
from conftest import random_prompts, teacher_forced_logprobs  # noqa: E402

from unison.dist.runtime import local  # noqa: E402
from unison.dist.tensor_parallel import full_state_dict  # noqa: E402
from unison.dist.topology import init_topology  # noqa: E402
from unison.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from unison.models import load_policy  # noqa: E402


def generate(model, graphs: bool, topology) -> tuple[list, dict]:
    engine = Engine(model, EngineConfig(num_blocks=256, block_size=16, max_batch_tokens=256, seed=0,
                                        cuda_graphs=graphs), topology=topology)
    done = engine.generate(random_prompts([7, 33, 100, 250], vocab=model.config.vocab_size),
                           SamplingParams(max_new_tokens=40, n=4, seed=3, stop_token_ids=()))
    return done, engine.stats()


def max_diff(whole, done) -> float:
    return max((teacher_forced_logprobs(whole, c.prompt_ids, c.token_ids) - torch.tensor(c.logprobs)).abs().max().item()
               for c in done)


def main():
    model_dir, out = sys.argv[1:]
    topology = init_topology(2, 120.0, "cuda")
    tp = topology.tp
    model, _ = load_policy(model_dir, dtype=torch.float32, device=str(tp.device), topology=topology)
    whole, _ = load_policy(model_dir, dtype=torch.float32, device=str(tp.device))
    result = {}
    eager, _ = generate(model, graphs=False, topology=topology)
    done, stats = generate(model, graphs=True, topology=topology)
    result.update(tokens=[c.token_ids for c in done], eager_tokens=[c.token_ids for c in eager],
                  graph_steps=stats["graph_steps"], diff=max_diff(whole, done), eager_diff=max_diff(whole, eager))
    with torch.no_grad():  # an in-place update of every shard, as the optimizer makes (the training step's packed
        for p in model.parameters():  # attention needs bf16; this check runs in fp32)
            local(p).mul_(1.02)
    whole.load_state_dict(full_state_dict(model))
    after, stats = generate(model, graphs=True, topology=topology)
    result.update(tokens_after=[c.token_ids for c in after], diff_after=max_diff(whole, after))
    with open(os.path.join(out, f"rank{tp.rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
