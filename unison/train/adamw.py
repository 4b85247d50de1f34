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


@dataclass(frozen=True)
class AdamWStep:
    """One step's AdamW hyperparameters, applied to a tensor by calling it (``adamw_step``); a store that steps many
    tensors at once (``DeviceStore``'s one-launch path) reads them from here."""
    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_scale: float = 1.0

    def __call__(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 grad: torch.Tensor) -> None:
        adamw_step(master, grad, exp_avg, exp_avg_sq, step=self.step, lr=self.lr, beta1=self.beta1, beta2=self.beta2,
                   eps=self.eps, weight_decay=self.weight_decay, grad_scale=self.grad_scale)

    def kernel_scalars(self) -> dict[str, float]:
        """The Triton kernels' arguments (``unison.train.triton_adamw``), from Python doubles."""
        return dict(grad_scale=self.grad_scale, decay=1.0 - self.lr * self.weight_decay, beta1=self.beta1,
                    beta2=self.beta2, step_size=self.lr / (1.0 - self.beta1**self.step),
                    bc2_sqrt=math.sqrt(1.0 - self.beta2**self.step), eps=self.eps)


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               grad_scale: float = 1.0, kernel: bool = True) -> None:
    """One AdamW update in place, operation for operation torch.optim.AdamW's single-tensor path.

    master, grad, exp_avg, exp_avg_sq: same shape, float32. ``step`` counts from 1 (bias correction). On the GPU
    one kernel (``unison.train.triton_adamw``) with ``kernel``; PyTorch's operations otherwise.
    """
    if kernel and master.is_cuda and 0.5 < beta1 < 1.0 and _kernels().covered(master, grad, exp_avg, exp_avg_sq):
        scalars = AdamWStep(step, lr, beta1, beta2, eps, weight_decay, grad_scale).kernel_scalars()
        _kernels().adamw_step(master, grad, exp_avg, exp_avg_sq, **scalars)
        return
    grad = grad.to(torch.float32)
    if grad_scale != 1.0:
        grad = grad * grad_scale
    master.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def write_back(param: torch.Tensor, master: torch.Tensor, kernel: bool = True) -> torch.Tensor:
    """Copy master (fp32) into param in its own dtype, in place.

    Returns a bool mask of param's shape, true exactly where the stored bits changed."""
    if kernel and param.is_cuda and param.dtype == torch.bfloat16 and _kernels().covered(param, master):
        return _kernels().write_back(param, master)
    new = master.to(param.dtype)
    mask = changed_bits(new, param)
    param.copy_(new)
    return mask


def _kernels():
    from . import triton_adamw  # Triton only where the kernels run
    return triton_adamw


def global_grad_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm over all ``grads`` together, accumulated in fp32 whatever their dtype."""
    if not grads:
        return 0.0
    # One multi-tensor launch per device and dtype, as torch.nn.utils.clip_grad_norm_'s foreach path (a norm per
    # tensor, most with a memset, took ~500 launches a step at the Qwen3-0.6B shape).
    norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    return float(torch.linalg.vector_norm(norms))
