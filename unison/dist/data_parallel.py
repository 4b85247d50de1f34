"""Data parallelism: gradients summed across replicas once per optimizer step, and the optimizer state sharded.

Each replica trains on its own samples with the loss normalised by the trained tokens of all replicas
(``global_sum``), so after ``all_reduce_grads`` every replica holds the gradient one process would compute on
all the samples. The optimizer (``unison.train.ownership``) then keeps fp32 masters and moments only for the
parameters a replica owns (about 1/N of them, ``assign_owners``), steps those, and broadcasts their new values
from the owner; the other replicas derive their changed masks exactly by comparing what arrives with what they
hold.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .runtime import local


def global_sum(value: float, group=None, device: torch.device | str = "cpu") -> float:
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t.item())


def all_reduce_grads(params: list[torch.nn.Parameter], group=None) -> None:
    """Sum every parameter's gradient across the group, one flat buffer per dtype (a few large collectives
    instead of one per tensor). Every replica must hold gradients for the same parameters."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            grad = local(p.grad)  # under tensor parallelism: this rank's shard, summed with the same shard elsewhere
            by_dtype.setdefault(grad.dtype, []).append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def assign_owners(named: list[tuple[str, torch.nn.Parameter]], world: int) -> dict[str, int]:
    """Largest parameters first, each to the least-loaded rank: every rank gets about 1/world of the elements."""
    load = [0] * world
    owners = {}
    for name, p in sorted(named, key=lambda item: -item[1].numel()):
        rank = min(range(world), key=lambda r: load[r])
        owners[name] = rank
        load[rank] += p.numel()
    return owners
