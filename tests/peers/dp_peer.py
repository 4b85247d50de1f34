"""One replica of a two-process data-parallel step (run by tests/test_data_parallel.py; not a test module).

    python tests/peers/dp_peer.py OUT        (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment)

Trains the tiny model on this rank's half of fixed samples for 3 steps, once with the optimizer state
replicated, once sharded across the replicas, once sharded in host memory (optim.placement=host), then sharded on
uneven shares of the same samples (one step gives rank 1 none), and saves the parameters of all four.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest and the test modules
from conftest import teacher_forced_logprobs, tiny_llama  # noqa: E402

from unison.dist.topology import Ranks, Topology  # noqa: E402
from unison.rollout.sample import Sample  # noqa: E402
from unison.train.loss import LossConfig  # noqa: E402
from unison.train.optimizer import OptimConfig, build_optimizer  # noqa: E402
from unison.train.step import train_step  # noqa: E402

STEPS = 3


_REFERENCE = None


def step_samples(step: int) -> list[Sample]:
    """8 samples of uneven lengths; the same on every rank (each takes its half). Their engine logprobs are the
    initial model's, slightly perturbed, so the importance ratios stay inside the loss's bounds."""
    global _REFERENCE
    _REFERENCE = _REFERENCE or tiny_llama()
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(8):
        n_prompt, n_completion = 3 + i % 4, 5 + (3 * i) % 7
        ids = torch.randint(3, 256, (n_prompt + n_completion,), generator=g).tolist()
        engine = (teacher_forced_logprobs(_REFERENCE, ids[:n_prompt], ids[n_prompt:])
                  + 0.05 * torch.randn(n_completion, generator=g)).tolist()
        out.append(Sample(tuple(ids[:n_prompt]), tuple(ids[n_prompt:]), tuple(engine), (0,) * n_completion,
                          reward=float(i % 3), advantage=float(i % 3) - 1.0))
    return out


# Shares of the 8 samples per step when replicas agree on ready counts: uneven, and once nothing for rank 1.
UNEVEN = [(6, 2), (8, 0), (3, 5)]


def run(sharded: bool, rank: int, world: int, group, uneven: bool = False, placement: str = "gpu"
        ) -> dict[str, torch.Tensor]:
    model = tiny_llama()
    cfg = OptimConfig(lr=1e-3, weight_decay=0.01, max_grad_norm=1.0, placement=placement)
    cpu = torch.device("cpu")
    topology = Topology(cpu, rank, world, dp=Ranks(rank, world, cpu, group))
    opt = build_optimizer(model, cfg, STEPS, topology if sharded else None)
    norms = []
    for step in range(STEPS):
        first = UNEVEN[step][0]
        mine = step_samples(step)[rank::world] if not uneven else \
            step_samples(step)[:first] if rank == 0 else step_samples(step)[first:]
        norms.append(train_step(model, opt, mine, LossConfig(), 1.0, 64, 0, 16, topology=topology)["optim/grad_norm"])
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "grad_norms": norms}


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    result = {"replicated": run(False, rank, world, group), "sharded": run(True, rank, world, group),
              "host": run(True, rank, world, group, placement="host"),
              "uneven": run(True, rank, world, group, uneven=True)}
    torch.save(result, os.path.join(sys.argv[1], f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
