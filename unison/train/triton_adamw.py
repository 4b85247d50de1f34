"""The fp32-master AdamW step and its bf16 write-back as one Triton kernel each (``unison.train.adamw``).

PyTorch runs ``adamw_step`` as about ten elementwise kernels per tensor and ``write_back`` as three, each reading
and writing fp32 state: ~130 bytes of traffic per parameter, 55-80 ms a step for the Qwen3-0.6B and 1.7B shapes on
the H200, launch-bound at the small tensors (bench/results/h200/speed). These read each operand once and write each
result once (35 bytes per parameter). Same arithmetic in the same order, IEEE square root and division, no fused
multiply-adds: the result is torch's to within a rounding step of fp32 (tests/test_fused_train.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 2048


@triton.jit
def _adamw_kernel(MASTER, GRAD, EXP_AVG, EXP_AVG_SQ, n, grad_scale, decay, one_minus_beta1, beta2, one_minus_beta2,
                  step_size, bc2_sqrt, eps, BLOCK: tl.constexpr):
    """The scalars come from Python doubles rounded to fp32 once, as torch rounds its scalar arguments."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(GRAD + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    p = tl.load(MASTER + offs, mask=mask, other=0.0) * decay
    m = tl.load(EXP_AVG + offs, mask=mask, other=0.0)
    m = m + one_minus_beta1 * (g - m)  # torch's lerp for a weight below 0.5
    v = tl.load(EXP_AVG_SQ + offs, mask=mask, other=0.0) * beta2 + one_minus_beta2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(MASTER + offs, p, mask=mask)
    tl.store(EXP_AVG + offs, m, mask=mask)
    tl.store(EXP_AVG_SQ + offs, v, mask=mask)


@triton.jit
def _write_back_kernel(MASTER, PARAM_BITS, CHANGED, n, BLOCK: tl.constexpr):
    """bf16(master) into the parameter's bits, rounded to nearest even in integer arithmetic (torch's rounding; a NaN
    master, which a step with a non-finite gradient norm never makes, becomes 0x7FC0), and where those bits changed."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(MASTER + offs, mask=mask, other=0.0)
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16)
    new = tl.where(x != x, 0x7FC0, rounded).to(tl.int16, bitcast=True)
    old = tl.load(PARAM_BITS + offs, mask=mask, other=0)
    tl.store(PARAM_BITS + offs, new, mask=mask)
    tl.store(CHANGED + offs, (new != old).to(tl.uint8), mask=mask)


def covered(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: contiguous, one device."""
    return all(t.is_contiguous() and t.device == tensors[0].device for t in tensors)


def adamw_step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               grad_scale: float, decay: float, beta1: float, beta2: float, step_size: float, bc2_sqrt: float,
               eps: float) -> None:
    """``unison.train.adamw.adamw_step`` in one pass, ``grad * grad_scale`` taken in fp32 from any float dtype."""
    n = master.numel()
    if not 0.5 < beta1 < 1.0:
        raise ValueError(f"the AdamW kernel follows torch's lerp for beta1 in (0.5, 1), got {beta1}")
    _adamw_kernel[(triton.cdiv(n, _BLOCK),)](master, grad, exp_avg, exp_avg_sq, n, grad_scale, decay, 1.0 - beta1,
                                             beta2, 1.0 - beta2, step_size, bc2_sqrt, eps, BLOCK=_BLOCK,
                                             num_warps=8, enable_fp_fusion=False)


def write_back(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``unison.train.adamw.write_back`` for a bf16 ``param``, in one pass."""
    if param.dtype != torch.bfloat16:
        raise ValueError(f"the write-back kernel takes bf16 parameters, not {param.dtype}")
    changed = torch.empty(param.shape, dtype=torch.bool, device=param.device)
    n = param.numel()
    _write_back_kernel[(triton.cdiv(n, _BLOCK),)](master, param.view(torch.int16), changed.view(torch.uint8), n,
                                                  BLOCK=_BLOCK, num_warps=8)
    return changed
