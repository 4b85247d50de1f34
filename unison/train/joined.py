"""A SwiGLU MLP's gate and up projections as one GEMM each way, over weights laid out as one matrix
(``unison.engine.fused_linear.pack_projections``), with the SiLU and product in one kernel reading both halves.

The 0.6B training step is bound by the host's launches (bench/train_launches.py). Apart, gate and up cost two GEMMs
forward and four backward (each input gradient, each weight gradient); over the joined weight they cost one each
way: ``x @ [gate; up].T`` forward, then from ``[d gate | d up]``, which the SwiGLU's backward kernel writes side by
side, the input gradient and both weights' gradients (rows of one product). The q/k/v projections of attentions with
q/k norms do the same in ``unison.train.fused_qk``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..engine.fused_linear import joined
from .fused import joinable, swiglu, swiglu_backward

BLOCK = 1024


@triton.jit
def _gated_rows_kernel(GU, Y, DY, DGU, width, stride_gu, stride_y, BLOCK: tl.constexpr, BACKWARD: tl.constexpr):
    """Row program_id(0), columns [program_id(1) * BLOCK, ...) of a (rows, 2 * width) [gate | up]: forward,
    y = silu(gate) * up (``swiglu``); backward, [d gate | d up] into DGU (GU's layout) given dy."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g_at = GU + row * stride_gu + cols
    g = tl.load(g_at, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_at + width, mask=mask, other=0.0)
    if BACKWARD:
        dg, du = swiglu_backward(g, u, tl.load(DY + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32))
        d_at = DGU + row * stride_gu + cols
        tl.store(d_at, dg.to(DGU.dtype.element_ty), mask=mask)
        tl.store(d_at + width, du.to(DGU.dtype.element_ty), mask=mask)
    else:
        tl.store(Y + row * stride_y + cols, swiglu(g, u).to(Y.dtype.element_ty), mask=mask)


def _gated(gu: torch.Tensor, width: int, dy: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up of gu = [gate | up] (rows, 2 * width), or with ``dy`` (rows, width) [d gate | d up]."""
    rows = gu.shape[0]
    out = gu.new_empty(rows, width) if dy is None else torch.empty_like(gu)
    grid = (rows, triton.cdiv(width, BLOCK))
    if dy is None:
        _gated_rows_kernel[grid](gu, out, out, gu, width, gu.stride(0), out.stride(0), BLOCK=BLOCK, BACKWARD=False,
                                 num_warps=4)
    else:
        _gated_rows_kernel[grid](gu, dy, dy, out, width, gu.stride(0), dy.stride(0), BLOCK=BLOCK, BACKWARD=True,
                                 num_warps=4)
    return out


class _GatedUp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate_weight, up_weight):
        rows = x.reshape(-1, x.shape[-1])
        gu = torch.mm(rows, joined([gate_weight, up_weight]).t())
        width = gate_weight.shape[0]
        ctx.save_for_backward(rows, gu, gate_weight, up_weight)
        ctx.x_shape = x.shape
        return _gated(gu, width).view(*x.shape[:-1], width)

    @staticmethod
    def backward(ctx, dy):
        rows, gu, gate_weight, up_weight = ctx.saved_tensors
        width = gate_weight.shape[0]
        dgu = _gated(gu, width, dy.reshape(-1, width).contiguous())
        dx = torch.mm(dgu, joined([gate_weight, up_weight])).view(ctx.x_shape) if ctx.needs_input_grad[0] else None
        dw = dgu.t().mm(rows) if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else None
        return dx, *((dw[:width], dw[width:]) if dw is not None else (None, None))


def gated_up(x: torch.Tensor, mlp: torch.nn.Module) -> torch.Tensor | None:
    """silu(gate_proj(x)) * up_proj(x) as one GEMM and one kernel each way where the two are plain bias-free
    ``nn.Linear`` layers of x's dtype without hooks whose weights are laid out as one matrix; else None (the caller
    runs them apart)."""
    gate, up = mlp.gate_proj, mlp.up_proj
    return _GatedUp.apply(x, gate.weight, up.weight) if joinable([gate, up], x) else None
