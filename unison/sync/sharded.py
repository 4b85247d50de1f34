"""The weight sync of a tensor-parallel trainer: each step's patch of the whole model, from its shards.

Servers hold the model whole. Under tensor parallelism every rank of the trainer's group holds a slice of each
sharded parameter (a DTensor, with its changed mask of the local shape) and a copy of the replicated ones (norms,
and whatever the plan leaves whole: embeddings, the head). ``ShardedPublisher`` is called by every rank of the group
at the same points as ``WeightPublisher`` (a collective): one parameter at a time, in name order, the shards and
their masks are gathered whole, and rank 0 of the group takes that tensor's changed elements (or all of them, for an
anchor) and its checksum into the patch, which it alone sends. So a receiver gets and verifies every parameter,
replicated and root-level ones included, exactly as a single-process trainer would send it; only one tensor is held
whole at a time. When a receiver asks for an anchor, rank 0 tells the group and the gather runs again whole.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..dist.topology import Ranks
from .codec import Patch, anchor_patch, sparse_patch
from .publisher import SyncConfig, build_sender


class ShardedPublisher:
    """``WeightPublisher``'s ``anchor`` / ``after_step`` for a tensor-parallel group (``tp``); ``params``: the
    parameters by name, on every rank. The sender (the connection to the servers) exists on rank 0 alone."""

    def __init__(self, cfg: SyncConfig, params: dict[str, torch.Tensor], tp: Ranks):
        self.cfg, self.tp = cfg, tp
        self.params = dict(sorted(params.items()))
        self.total = sum(p.numel() for p in self.params.values())  # a DTensor's numel is the whole tensor's
        self.syncs = 0
        device = next(iter(self.params.values())).device
        self.sender = build_sender(cfg, device) if tp.is_main else None

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    def anchor(self, version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        nbytes, anchors = self._deliver(self._patch(version, None, restart=True), version, anchor=True)
        return {"sync/bytes": float(nbytes), "sync/s": time.perf_counter() - t0, "sync/anchors": float(anchors)}

    def after_step(self, version: int, changed_masks: dict[str, torch.Tensor]) -> dict[str, float]:
        t0 = time.perf_counter()
        self.syncs += 1
        full = self.cfg.mode == "full" or (self.cfg.anchor_every and self.syncs % self.cfg.anchor_every == 0)
        patch = self._patch(version, None if full else changed_masks)
        nbytes, anchors = self._deliver(patch, version, anchor=bool(full))
        elements = patch.num_elements if patch is not None else 0
        return {"sync/bytes": float(nbytes), "sync/s": time.perf_counter() - t0,
                "sync/elements_frac": elements / self.total, "sync/anchors": float(anchors)}

    def _patch(self, version: int, masks: dict[str, torch.Tensor] | None, restart: bool = False) -> Patch | None:
        """The patch of the whole model (rank 0; None elsewhere): sparse from ``masks``, else an anchor."""
        main = self.tp.is_main
        patch = Patch(version - 1, version, anchor=False) if masks is not None else \
            Patch(-1, version, anchor=True, restart=restart)
        for name, param in self.params.items():
            if masks is not None and name not in masks:
                continue
            whole = {name: _whole(param.detach())}
            mask = None if masks is None else {name: _whole_mask(masks[name], param)}
            if main:  # this tensor's part, as a single-process trainer's publisher builds it
                to_host = self.sender.to_host  # dist sends from the device
                part = anchor_patch(whole, version, to_host) if mask is None else \
                    sparse_patch(whole, mask, version - 1, version, to_host)
                patch.indices.update(part.indices)
                patch.values.update(part.values)
                patch.checksums.update(part.checksums)
        return patch if main else None

    def _deliver(self, patch: Patch | None, version: int, anchor: bool) -> tuple[int, int]:
        """Rank 0 sends ``patch``; the group learns whether a receiver needs an anchor, and builds it together
        (``anchor``: the patch is one already, every rank knows)."""
        nbytes, receivers = 0, []
        if self.sender is not None:
            nbytes = self.sender.send(patch)
            receivers = self.sender.needs_anchor()
        need = [receivers]
        dist.broadcast_object_list(need, group_src=0, group=self.tp.group)
        if not need[0]:
            return nbytes, 0
        whole = patch if anchor else self._patch(version, None)
        if self.sender is None:
            return 0, 0
        return nbytes, self.sender.send_anchor(whole, need[0])


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _whole_mask(mask: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A parameter's changed mask of its local shape, whole (gathered like the parameter itself)."""
    if not isinstance(param, DTensor):
        return mask
    local = DTensor.from_local(mask.to(torch.uint8), param.device_mesh, param.placements, run_check=False,
                               shape=param.shape, stride=param.stride())
    return local.full_tensor().bool()
