"""Which bf16 elements an optimizer step changed, for optimizers that step bf16 parameters directly.

unison's own optimizer records exact masks at its fp32 write-back (``MasterAdamW.changed_masks``). A setup that
steps bf16 parameters with ``torch.optim.AdamW`` has no such record; this detector recovers it from the step's
own quantities. AdamW moves each element by u = -lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) after decaying it by
(1 - lr * wd); an element changed exactly when that move, undone from the new value, lands at least half a
spacing of the bf16 grid away from it. Near that boundary the call is ambiguous, so the guard band reports
elements within ``guard`` of it as changed: extra elements in a patch are harmless, a missed one would leave a
receiver stale (its checksum would catch it).
"""

from __future__ import annotations

import math

import torch

from ..bits import as_bits


def adamw_inversion_mask(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *, step: int,
                         lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                         guard: float = 0.1) -> torch.Tensor:
    """Bool mask of elements of ``param`` (after ``torch.optim.AdamW``'s step ``step``, counted from 1, at the lr
    that step actually used) that the step changed. ``exp_avg`` and ``exp_avg_sq`` are the state after the step."""
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    # The denominator exactly as torch.optim.AdamW's single-tensor path computes it, in the state's dtype.
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    move = (lr / bias_correction1) * exp_avg.float() / denom.float()
    new = param.float()
    old = (new + move) / (1.0 - lr * weight_decay)
    return (old - new).abs() >= (1.0 - guard) * 0.5 * _spacing(param)


def _spacing(x: torch.Tensor) -> torch.Tensor:
    """The smaller of the gaps to the two neighbours of each value on its dtype's grid (fp32)."""
    magnitude = x.abs()
    raw = as_bits(magnitude)
    up = (raw + 1).view(x.dtype).float() - magnitude.float()
    down = torch.where(raw > 0, magnitude.float() - (raw - 1).clamp(min=0).view(x.dtype).float(), up)
    return torch.minimum(up, down)
