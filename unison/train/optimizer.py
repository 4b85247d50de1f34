"""AdamW on fp32 master weights, written back into the live (bf16) parameters the engine reads.

Stepping bf16 parameters directly loses most of a 1e-6 update to rounding, so the optimizer keeps an
fp32 master, exp_avg and exp_avg_sq per parameter, steps those, and copies bf16(master) into the
parameter in place (same storage: the engine decodes from it). The write-back also yields the exact
set of elements that changed, which is what a sparse weight sync sends; no snapshot is needed because
the parameter itself is the receiver's state.

One optimizer, ``MasterAdamW``, composed of a state store (``state_store``: where the masters and moments live)
and an ownership policy (``ownership``: which parameters this rank steps and how the others get their new values);
``build_optimizer`` picks both from the config and the topology.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import check_literals
from ..dist.runtime import local
from ..dist.tensor_parallel import partial_grad_names
from ..dist.topology import Topology
from .adamw import AdamWStep
from .ownership import Ownership
from .state_store import DeviceStore, HostStore, StateStore


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.999
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """Added to AdamW's sqrt(second moment) in the update's denominator."""
    weight_decay: float = 0.0
    """Decoupled (AdamW) weight decay, applied as master *= 1 - lr * weight_decay."""
    placement: Literal["gpu", "host"] = "gpu"
    """Where fp32 masters and AdamW moments live: with the parameters, or in pinned host memory, streamed through
    the GPU chunk by chunk at each step (12 bytes per parameter off the GPU; bit-identical updates)."""
    max_grad_norm: float = 1.0
    """Clip the global fp32 gradient norm to this; 0 disables clipping."""
    schedule: Literal["constant", "warmup", "cosine"] = "constant"
    """'warmup': linear warmup then constant; 'cosine': linear warmup then cosine decay to min_lr_ratio."""
    warmup_steps: int = 0
    """Steps of linear warmup ('warmup' and 'cosine' schedules), reaching lr at step warmup_steps - 1."""
    min_lr_ratio: float = 0.0
    """Final lr of the cosine schedule, as a fraction of lr."""

    def __post_init__(self):
        if not self.lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {self.lr}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0.0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not self.max_grad_norm >= 0.0:
            raise ValueError(f"max_grad_norm must be >= 0, got {self.max_grad_norm}")
        check_literals(self)
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0 for the first step) of ``total_steps``.

    Warmup is linear and reaches ``cfg.lr`` at step ``warmup_steps - 1`` (the first step is not
    wasted at lr 0); cosine then decays to ``min_lr_ratio * lr`` at step ``total_steps - 1`` and stays.
    """
    if cfg.schedule == "constant":
        return cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "warmup":
        return cfg.lr
    decay_steps = total_steps - 1 - cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class StepStats:
    step: int
    """Optimizer steps taken so far, this one included."""
    lr: float
    grad_norm: float
    """Global fp32 gradient norm before clipping."""
    changed_fraction: float
    """Fraction of the stepped parameters' elements whose stored value changed."""
    num_changed: int


class MasterAdamW:
    """AdamW over fp32 masters of ``named_params`` (trainable ones; duplicates of a tied tensor once).

    After ``step()``: ``last_lr`` is the lr used, ``changed_masks[name]`` a bool tensor of the (local) parameter's
    shape that is true exactly where the stored parameter value changed (only parameters that had a grad, and so
    were stepped, appear), ``changed_fraction`` their overall changed fraction. Parameters without a grad are
    skipped entirely, as torch.optim.AdamW does. ``state[name]`` is the parameter's ``AdamState``, or None where
    another rank owns it. ``store`` defaults to ``DeviceStore()``, ``ownership`` to every parameter on this rank.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimConfig,
                 total_steps: int, store: StateStore | None = None, ownership: Ownership | None = None):
        if cfg.schedule == "cosine" and total_steps <= cfg.warmup_steps:
            raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({cfg.warmup_steps}) "
                             "for the cosine schedule")
        self.cfg = cfg
        self.total_steps = total_steps
        self.params = trainable(named_params)
        self.store = store if store is not None else DeviceStore()
        self.ownership = ownership if ownership is not None else Ownership()
        held = self.store.allocate({name: local(p) for name, p in self.params.items() if self.ownership.owns(name)})
        self.state = {name: held.get(name) for name in self.params}
        self.step_count = 0
        self.last_lr: float | None = None
        self.changed_masks: dict[str, torch.Tensor] = {}
        self.changed_fraction = 0.0

    def lr_at(self, step: int) -> float:
        return lr_at(step, self.cfg, self.total_steps)

    def state_dict(self) -> dict:
        """Step count and every fp32 master and moment this optimizer holds (CPU copies)."""
        return {"step_count": self.step_count,
                "state": {name: None if s is None else (s.master.cpu(), s.exp_avg.cpu(), s.exp_avg_sq.cpu())
                          for name, s in self.state.items()}}

    def load_state_dict(self, saved: dict) -> None:
        if set(saved["state"]) != set(self.state):
            raise ValueError("the saved optimizer state is for other parameters "
                             f"({sorted(set(saved['state']) ^ set(self.state))[:3]} differ)")
        for name, tensors in saved["state"].items():
            mine = self.state[name]
            if (tensors is None) != (mine is None):
                raise ValueError(f"{name}: the saved optimizer state was sharded differently")
            if mine is not None:
                for dst, src in zip((mine.master, mine.exp_avg, mine.exp_avg_sq), tensors, strict=True):
                    dst.copy_(src)
        self.step_count = saved["step_count"]

    @torch.no_grad()
    def step(self) -> StepStats:
        """Clip, step every parameter with a grad, write back; raises on a non-finite gradient norm."""
        self.ownership.reduce_grads(self.params)
        stepped = {name: p for name, p in self.params.items() if p.grad is not None}
        grad_norm = self.ownership.grad_norm(stepped)
        if not math.isfinite(grad_norm):
            # Stepping would spread NaN/inf through every master, and the engine decodes from them.
            raise FloatingPointError(f"non-finite gradient norm {grad_norm} at step {self.step_count}")
        grad_scale = 1.0
        if self.cfg.max_grad_norm > 0:
            # Same coefficient as torch.nn.utils.clip_grad_norm_.
            grad_scale = min(1.0, self.cfg.max_grad_norm / (grad_norm + 1e-6))
        lr = self.lr_at(self.step_count)
        self.step_count += 1
        self.last_lr = lr
        work = [(name, self.state[name], local(p.data), local(p.grad))
                for name, p in stepped.items() if self.ownership.owns(name)]
        self.changed_masks = self.ownership.share(stepped, self.store.update(work, self._update(grad_scale, lr)))
        num_changed = _count_true(self.changed_masks.values())
        numel = sum(m.numel() for m in self.changed_masks.values())
        self.changed_fraction = num_changed / numel if numel else 0.0
        return StepStats(step=self.step_count, lr=lr, grad_norm=grad_norm,
                         changed_fraction=self.changed_fraction, num_changed=num_changed)

    def _update(self, grad_scale: float, lr: float) -> AdamWStep:
        """This step's AdamW arithmetic on one tensor (or a chunk of one), for the store to run where it keeps it."""
        cfg = self.cfg
        return AdamWStep(step=self.step_count, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                         weight_decay=cfg.weight_decay, grad_scale=grad_scale)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None


def _count_true(masks: Iterable[torch.Tensor]) -> int:
    """True elements over ``masks``, counted on the device and read once (a read per tensor waited on the GPU ~300
    times a step). Masks that are views of one buffer (``DeviceStore``'s one-launch step writes them all into one)
    are counted in one sum over it: the store's buffer holds their elements and False padding, nothing else."""
    bases = {}
    for m in masks:
        base = m if m._base is None else m._base
        bases[id(base)] = base
    counts = [b.sum() for b in bases.values()]
    return int(torch.stack(counts).sum()) if counts else 0


def trainable(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.nn.Parameter]:
    """The parameters that train, each once under its first name (tied weights share one tensor)."""
    params: dict[str, torch.nn.Parameter] = {}
    seen: set[int] = set()
    for name, p in named_params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params[name] = p
    return params


def build_optimizer(model_or_named_params: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
                    cfg: OptimConfig, total_steps: int, topology: Topology | None = None) -> MasterAdamW:
    """The run's optimizer: its state where ``cfg.placement`` says, owned as ``topology`` says (its tensor-parallel
    group steps the local shards, which needs the model itself, whose plan names the partial-gradient norms; its
    data-parallel replicas split the state between them).

    >>> opt = build_optimizer(torch.nn.Linear(4, 2), OptimConfig(placement="host"), total_steps=10)
    >>> type(opt.store).__name__, opt.ownership.owner is None
    ('HostStore', True)
    """
    tp = topology.tp if topology is not None else None
    dp = topology.dp if topology is not None else None
    if isinstance(model_or_named_params, torch.nn.Module):
        named = model_or_named_params.named_parameters()
        partial = partial_grad_names(model_or_named_params) if tp is not None else ()
    elif tp is not None:
        raise TypeError("build_optimizer: tensor parallelism needs the model, not its named parameters (the model's "
                        "plan names the norms whose gradients are summed over the group)")
    else:
        named, partial = model_or_named_params, ()
    params = trainable(named)
    store = HostStore() if cfg.placement == "host" else DeviceStore()
    return MasterAdamW(params.items(), cfg, total_steps, store=store,
                       ownership=Ownership(params, dp=dp, tp=tp, partial=partial))
