"""Which parameters this rank's optimizer steps, and how the new values reach the ranks that did not step them.

- alone: every parameter, whole.
- ``dp`` (data-parallel replicas, ZeRO stage 1): each parameter is owned by one replica (about 1/N of the elements
  each, ``assign_owners``); the owner steps it and broadcasts its new value, the others derive their changed masks
  exactly by comparing what arrives with what they hold.
- ``tp`` (tensor parallelism): every rank steps the local shard of each parameter (``local``; a replicated one is
  its own shard). Replicated parameters whose gradient covers only this rank's heads (``partial``) have it summed
  over the tp group once per step, and the clipping norm counts each element of the full model once.
- dp x tp: both; the owning replica's tp ranks each broadcast their shard to the same tp rank of the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..bits import changed_bits
from ..dist.data_parallel import all_reduce_grads, assign_owners
from ..dist.runtime import local
from ..dist.topology import Ranks
from .adamw import global_grad_norm


class Ownership:
    def __init__(self, params: dict[str, torch.nn.Parameter] | None = None, dp: Ranks | None = None,
                 tp: Ranks | None = None, partial: Iterable[str] = ()):
        self.dp, self.tp = dp, tp
        self.owner = assign_owners(list(params.items()), dp.world) if dp is not None else None
        self.partial = sorted(partial)

    def owns(self, name: str) -> bool:
        return self.owner is None or self.owner[name] == self.dp.rank

    def reduce_grads(self, params: dict[str, torch.nn.Parameter]) -> None:
        """Sum the partial gradients over the tp group (before the norm and the step)."""
        if self.tp is not None:
            all_reduce_grads([params[name] for name in self.partial if name in params], self.tp.group)

    def grad_norm(self, stepped: dict[str, torch.nn.Parameter]) -> float:
        """The global fp32 norm of the gradients of ``stepped`` (the whole model's under tensor parallelism)."""
        if self.tp is None:
            return global_grad_norm([p.grad for p in stepped.values()])
        sharded = torch.zeros((), dtype=torch.float32, device=self.tp.device)
        replicated = torch.zeros((), dtype=torch.float32, device=self.tp.device)
        for p in stepped.values():
            sq = torch.linalg.vector_norm(local(p.grad), dtype=torch.float32).square()
            if isinstance(p, DTensor):
                sharded += sq
            else:
                replicated += sq
        dist.all_reduce(sharded, group=self.tp.group)
        return float((sharded + replicated).sqrt())

    def share(self, stepped: dict[str, torch.nn.Parameter], updated: Iterator[tuple[str, torch.Tensor]]
              ) -> dict[str, torch.Tensor]:
        """The changed mask of every parameter of ``stepped``: from ``updated`` (the store stepping the owned ones,
        in order) where this rank owns it, else from the owner's broadcast, in the same order on every replica (so
        the collectives match)."""
        masks = {}
        for name, p in stepped.items():
            data = local(p.data)
            if self.owns(name):
                stepped_name, masks[name] = next(updated)
                assert stepped_name == name, (stepped_name, name)
                if self.owner is not None:
                    dist.broadcast(data, self._owner_rank(name), group=self.dp.group)
            else:
                new = torch.empty_like(data)
                dist.broadcast(new, self._owner_rank(name), group=self.dp.group)
                masks[name] = changed_bits(new, data)
                data.copy_(new)
        if next(updated, None) is not None:  # also runs the store to its end (its last copies out)
            raise RuntimeError("the state store stepped parameters this rank does not own")
        return masks

    def _owner_rank(self, name: str) -> int:
        group = self.dp.group
        return dist.get_global_rank(group, self.owner[name]) if group is not None else self.owner[name]
