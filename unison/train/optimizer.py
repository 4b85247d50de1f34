"""AdamW on fp32 master weights, written back into the live (bf16) parameters the engine reads.

Stepping bf16 parameters directly loses most of a 1e-6 update to rounding, so the optimizer keeps an
fp32 master, exp_avg and exp_avg_sq per parameter, steps those, and copies bf16(master) into the
parameter in place (same storage: the engine decodes from it). The write-back also yields the exact
set of elements that changed, which is what a sparse weight sync sends; no snapshot is needed because
the parameter itself is the receiver's state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
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
        if self.placement not in ("gpu", "host"):
            raise ValueError(f"placement must be 'gpu' or 'host', got {self.placement!r}")
        if self.schedule not in ("constant", "warmup", "cosine"):
            raise ValueError(f"schedule must be 'constant', 'warmup' or 'cosine', got {self.schedule!r}")
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


@dataclass
class _AdamState:
    master: torch.Tensor  # fp32, the parameter's shape
    exp_avg: torch.Tensor  # fp32
    exp_avg_sq: torch.Tensor  # fp32


class MasterAdamW:
    """AdamW over fp32 masters of ``named_params`` (trainable ones; duplicates of a tied tensor once).

    After ``step()``: ``last_lr`` is the lr used, ``changed_masks[name]`` a bool tensor of the
    parameter's shape that is true exactly where the stored parameter value changed (only parameters
    that had a grad, and so were stepped, appear), ``changed_fraction`` their overall changed fraction.
    Parameters without a grad are skipped entirely, as torch.optim.AdamW does.
    """

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimConfig,
                 total_steps: int):
        if cfg.schedule == "cosine" and total_steps <= cfg.warmup_steps:
            raise ValueError(f"total_steps ({total_steps}) must exceed warmup_steps ({cfg.warmup_steps}) "
                             "for the cosine schedule")
        self.cfg = cfg
        self.total_steps = total_steps
        self.params = trainable(named_params)
        self.state = {name: self._new_state(name, p) for name, p in self.params.items()}
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
        stepped = {name: p for name, p in self.params.items() if p.grad is not None}
        grad_norm = self._grad_norm(stepped)
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
        self.changed_masks = self._update_all(stepped, grad_scale, lr)
        num_changed = sum(int(m.sum()) for m in self.changed_masks.values())
        numel = sum(m.numel() for m in self.changed_masks.values())
        self.changed_fraction = num_changed / numel if numel else 0.0
        return StepStats(step=self.step_count, lr=lr, grad_norm=grad_norm,
                         changed_fraction=self.changed_fraction, num_changed=num_changed)

    def _grad_norm(self, stepped: dict[str, torch.nn.Parameter]) -> float:
        return global_grad_norm([p.grad for p in stepped.values()])

    @staticmethod
    def _shard(t: torch.Tensor) -> torch.Tensor:
        """The part of a parameter (or its gradient) this optimizer steps: all of it, except under tensor
        parallelism."""
        return t

    def _new_state(self, name: str, param: torch.nn.Parameter) -> _AdamState | None:
        param = self._shard(param)
        return _AdamState(master=param.detach().to(torch.float32, copy=True),
                          exp_avg=torch.zeros_like(param, dtype=torch.float32),
                          exp_avg_sq=torch.zeros_like(param, dtype=torch.float32))

    def _update_all(self, stepped: dict[str, torch.nn.Parameter], grad_scale: float, lr: float
                    ) -> dict[str, torch.Tensor]:
        return {name: self._update(name, p, grad_scale, lr) for name, p in stepped.items()}

    def _update(self, name: str, param: torch.nn.Parameter, grad_scale: float, lr: float) -> torch.Tensor:
        """Step one parameter and write it back; returns its changed mask. The unit a streamed-from-host
        variant wraps with its copy-in / copy-out."""
        state = self.state[name]
        grad = self._shard(param.grad).to(torch.float32)
        if grad_scale != 1.0:
            grad = grad * grad_scale
        adamw_step(state.master, grad, state.exp_avg, state.exp_avg_sq, step=self.step_count, lr=lr,
                   beta1=self.cfg.beta1, beta2=self.cfg.beta2, eps=self.cfg.eps,
                   weight_decay=self.cfg.weight_decay)
        return write_back(self._shard(param.data), state.master)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None


def trainable(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, torch.nn.Parameter]:
    """The parameters that train, each once under its first name (tied weights share one tensor)."""
    params: dict[str, torch.nn.Parameter] = {}
    seen: set[int] = set()
    for name, p in named_params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params[name] = p
    return params


def make_optimizer(named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: OptimConfig,
                   total_steps: int) -> MasterAdamW:
    """The optimizer ``cfg.placement`` asks for."""
    if cfg.placement == "host":
        from .streamed import HostAdamW
        return HostAdamW(named_params, cfg, total_steps)
    return MasterAdamW(named_params, cfg, total_steps)


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW update in place, operation for operation torch.optim.AdamW's single-tensor path.

    master, grad, exp_avg, exp_avg_sq: same shape, float32. ``step`` counts from 1 (bias correction).
    """
    master.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def write_back(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """Copy master (fp32) into param in its own dtype, in place.

    Returns a bool mask of param's shape, true exactly where the stored bits changed."""
    new = master.to(param.dtype)
    mask = changed_bits(new, param)
    param.copy_(new)
    return mask


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory viewed as signed integers of the element's width."""
    return t.view(_BITS[t.element_size()])


def changed_bits(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Where the stored bits differ. Bits, not values: -0.0 == 0.0 would leave a receiver's bytes (and checksum)
    stale."""
    return as_bits(new) != as_bits(old)


def global_grad_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm over all ``grads`` together, accumulated in fp32 whatever their dtype."""
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    return float(torch.linalg.vector_norm(norms))
