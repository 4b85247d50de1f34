"""One rank of a two-process tensor-parallel trainer that sends its weights (run by tests/test_sync_tensor_parallel.py;
not a test module).

    python tests/peers/tp_sync_peer.py MODEL_DIR PATCH_DIR OUT    (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)

Loads the model in bf16 sharded across the two ranks, sends the restart anchor into PATCH_DIR (the fsspec
transport), then trains STEPS steps on random samples, each followed by the sparse patch of the whole model. Each rank
saves the trainer's whole state dict and its sync metrics to OUT/rank<r>.pt.
"""

from __future__ import annotations

import os
import random
import sys

import torch
import torch.distributed as dist

from unison.dist.tensor_parallel import full_state_dict
from unison.dist.topology import init_topology
from unison.models import load_policy
from unison.rollout.sample import Sample
from unison.sync.publisher import SyncConfig
from unison.sync.sharded import ShardedPublisher
from unison.sync.transports import FsspecConfig
from unison.train.loss import LossConfig
from unison.train.optimizer import OptimConfig, build_optimizer
from unison.train.step import train_step

STEPS = 4


def samples(step: int) -> list[Sample]:
    rng = random.Random(step)
    out = []
    for i in range(8):
        completion = tuple(rng.randrange(3, 256) for _ in range(6))
        prompt = tuple(rng.randrange(3, 256) for _ in range(5))
        out.append(Sample(prompt, completion, (-5.545,) * 6, (step - 1,) * 6,  # ~ log(1/256): the tiny model's
                          reward=float(i % 2), advantage=1.0 if i % 2 else -1.0))
    return out


def main():
    model_dir, patch_dir, out = sys.argv[1:]
    topology = init_topology(2, 120.0, "cpu")
    model, _ = load_policy(model_dir, dtype=torch.bfloat16, topology=topology)  # bf16: sparse steps
    optimizer = build_optimizer(model, OptimConfig(lr=1e-4), STEPS, topology)
    cfg = SyncConfig(mode="sparse", transport="fsspec", servers=["http://127.0.0.1:9"], anchor_every=0,
                     fsspec=FsspecConfig(url=patch_dir))
    publisher = ShardedPublisher(cfg, dict(model.named_parameters()), topology.tp)
    metrics = [publisher.anchor(0)]
    for step in range(1, STEPS + 1):
        train_step(model, optimizer, samples(step), LossConfig(), 1.0, 40, 0, 16, topology=topology)
        metrics.append(publisher.after_step(step, optimizer.changed_masks))
    whole = full_state_dict(model)
    publisher.close()
    torch.save({"params": whole, "metrics": metrics}, os.path.join(out, f"rank{topology.tp.rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
