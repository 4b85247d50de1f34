"""The arithmetic of one fp32-master AdamW step, shared by every state store and ownership policy."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..bits import changed_bits


@dataclass
class AdamState:
    """One parameter's (or its local shard's) optimizer state, wherever the store keeps it."""
    master: torch.Tensor
    """fp32, the shape of the (local) parameter."""
    exp_avg: torch.Tensor
    """fp32, same shape."""
    exp_avg_sq: torch.Tensor
    """fp32, same shape."""


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


def global_grad_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm over all ``grads`` together, accumulated in fp32 whatever their dtype."""
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
    return float(torch.linalg.vector_norm(norms))
