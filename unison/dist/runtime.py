"""`torchrun --nproc-per-node N -m unison train ...`: N data-parallel replicas on torch.distributed.

Each replica runs its own engine and rollouts on its own prompts (its seed is the run's plus its rank) and
trains on its own share of the step's samples; ``train_step`` normalises the loss by every replica's tokens
and sums the gradients once; ``ShardedAdamW`` keeps 1/N of the optimizer state per replica. Rank 0 writes the
metrics (averaged over replicas, maxima as maxima, token counts summed) and the checkpoints. Every collective
times out after ``dist.timeout_s``, so a replica that dies makes the others fail with an error instead of
waiting forever.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class DistConfig:
    tp: int = 1
    """Tensor-parallel degree: > 1 shards the model across groups of that many processes; torchrun's N processes
    make N / tp data-parallel replicas."""
    timeout_s: float = 300.0
    """A collective that waits longer than this fails the run: a dead replica is reported, not waited on."""

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"dist.tp must be >= 1, got {self.tp}")
        if not self.timeout_s > 0:
            raise ValueError(f"dist.timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class Replica:
    rank: int
    world: int
    device: torch.device
    group: object

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_replicas(cfg: DistConfig, device_type: str) -> Replica | None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, ...); None when running alone."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return None
    device = join_torchrun(device_type, cfg.timeout_s)
    return Replica(dist.get_rank(), dist.get_world_size(), device, dist.group.WORLD)


def join_torchrun(device_type: str, timeout_s: float) -> torch.device:
    """Join the process group torchrun describes (NCCL on GPUs, gloo on the CPU); returns this process's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    return device


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel parameter or gradient (a DTensor; the same memory), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def reduce_metrics(metrics: dict[str, float], replica: Replica) -> dict[str, float]:
    """Every replica's metrics in one dict: maxima as maxima, token and row counts summed, the rest averaged."""
    gathered: list[dict] = [None] * replica.world
    dist.all_gather_object(gathered, metrics, group=replica.group)
    out = {}
    for key in {k for m in gathered for k in m}:
        values = [m[key] for m in gathered if m.get(key) is not None]
        if not values:
            out[key] = None
        elif "max" in key:
            out[key] = max(values)
        elif key.startswith("train/") and key.endswith(("tokens", "rows")):
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def agree_with_rank0(value, ranks: Replica, what: str) -> None:
    """Raise if any rank of ``ranks`` holds another ``value`` (any picklable) than its rank 0: ``what`` names the
    ranks and the value in the error."""
    gathered: list = [None] * ranks.world
    dist.all_gather_object(gathered, value, group=ranks.group)
    bad = [rank for rank, other in enumerate(gathered) if other != gathered[0]]
    if bad:
        raise RuntimeError(what.format(bad))


def check_replicas_agree(model: torch.nn.Module, replica: Replica) -> None:
    """Raise if any replica's parameters differ from rank 0's (they must be identical after every step)."""
    from ..sync.codec import checksum

    agree_with_rank0({name: checksum(local(p)) for name, p in model.named_parameters()}, replica,
                     "data-parallel replicas {} hold parameters that differ from rank 0's")
