"""The training forward's mixture-of-experts experts on unison's Triton kernels, with their backward.

The forward is the engine's (``unison.engine.triton_moe``: the routing permutation folded into the kernels' loads,
the outputs equal to transformers' ``grouped_mm`` path), which also keeps each (token, expert) pair's gate and up
values. The backward reuses its routing (the pairs sorted by expert, in blocks of one expert) in three kernels:

1. ``_act_grad_kernel`` (blocks of pairs x columns of I): z = dout[token] W_down_e, then in registers each pair's
   routing-weight gradient (its partial sum of z * act over the tile's columns), dact = w * z and the gate's
   derivative, written as the gradient of the gate and up values (S, 2I).
2. ``_input_grad_kernel`` (blocks of pairs x columns of H): that times W_gate_up_e, per pair; the sum over each
   token's top-k pairs in fp32 (torch's: deterministic, no atomics).
3. ``_weight_grad_kernel`` (experts x tiles of the weight): each expert's weight gradient, summed over its pairs
   in their sorted order: dW_down_e = sum (w dout[token])^T act, dW_gate_up_e = sum dpre^T x[token].

Products accumulate in fp32 and each output is rounded once to its dtype (the weights' for the weight gradients).
GptOss's biases take their gradients in torch ops (an index_add over the pairs; a (T, E) product for the routing
weights' share). ``experts_training(model)`` switches the supported experts modules (``unison.engine.moe``) for the
``with`` block (it must span the backward under activation checkpointing). The trainer does not enter it: on one
H200 the backward is slower than transformers' grouped_mm at training shapes (Qwen3-30B-A3B's layer at 8192 tokens:
8.05 against 6.66 ms forward + backward; bench/results/h200/moe_train), while the forward alone ties or wins. The
CPU keeps transformers' path (the kernels run there only in Triton's interpreter, in the tests).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
import triton
import triton.language as tl

from ..engine import moe
from ..engine.triton_moe import (
    _INTERPRET,
    BlockSizes,
    ExpertsLayout,
    _block_rows,
    _dot_rows,
    _round,
    _strides,
    experts_forward,
    launch_args,
    rounded_limit,
)


@triton.jit
def _gate_grad(gate, up, dact, alpha, limit, GATE: tl.constexpr):
    """d gate and d up of the gate on fp32 ``gate``/``up`` given d act (the derivative of ``gate_reference``)."""
    if GATE == "gptoss":  # (clamp(up) + 1) * g * sigmoid(g * alpha), g = min(gate, limit): clamps pass inside
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-g * alpha))
        d_up = tl.where((up >= -limit) & (up <= limit), dact * g * sig, 0.0)
        d_glu = dact * (u + 1.0)
        d_gate = tl.where(gate <= limit, d_glu * (sig + g * alpha * sig * (1.0 - sig)), 0.0)
        return d_gate, d_up
    sig = 1.0 / (1.0 + tl.exp(-gate))
    return dact * up * sig * (1.0 + gate * (1.0 - sig)), dact * gate * sig


@triton.jit
def _act_grad_kernel(G, W, Pre, Act, RouteW, DPre, DRoute, Perm, Bounds, FirstBlock, BlockExpert,
                     stride_g, stride_we, stride_wn, stride_wk, num_experts, top_k, K, N, n_tiles, alpha, limit,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                     PRECISION: tl.constexpr, INTERLEAVED: tl.constexpr, GATE: tl.constexpr):
    """z = G[token] W_down_e over K = H for a block of pairs and N-tile of I; DRoute[pair, tile] = sum z * act,
    DPre[pair] = the gate's derivative at Pre[pair] times route * z."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    if e >= num_experts:
        return
    pair, live = _block_rows(Perm, Bounds, FirstBlock, e, pid_m, BLOCK_M)
    token = (pair // top_k).to(tl.int64)
    rows = pair.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    mask = live[:, None] & n_ok[None, :]
    z = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    z = _dot_rows(z, G, token, live, stride_g, W + e.to(tl.int64) * stride_we, n, n_ok, stride_wn, stride_wk, K,
                  BLOCK_K, UPCAST, PRECISION)
    act = tl.load(Act + rows[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DRoute + rows * n_tiles + pid_n, tl.sum(z * act, axis=1), mask=live)
    dact = z * tl.load(RouteW + rows, mask=live, other=0.0).to(tl.float32)[:, None]
    gate_col = 2 * n if INTERLEAVED else n
    up_col = 2 * n + 1 if INTERLEAVED else N + n
    pre = Pre + rows[:, None] * (2 * N)
    gate = tl.load(pre + gate_col[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(pre + up_col[None, :], mask=mask, other=0.0).to(tl.float32)
    d_gate, d_up = _gate_grad(gate, up, dact, alpha, limit, GATE)
    dtype = DPre.dtype.element_ty
    dpre = DPre + rows[:, None] * (2 * N)
    tl.store(dpre + gate_col[None, :], _round(d_gate, dtype, UPCAST), mask=mask)
    tl.store(dpre + up_col[None, :], _round(d_up, dtype, UPCAST), mask=mask)


@triton.jit
def _input_grad_kernel(DPre, W, DX, Perm, Bounds, FirstBlock, BlockExpert, stride_we, stride_wn, stride_wk,
                       num_experts, K, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """DX[pair] = DPre[pair] W_gate_up_e over K = 2I, for a block of pairs and an N-tile of H."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    if e >= num_experts:
        return
    pair, live = _block_rows(Perm, Bounds, FirstBlock, e, pid_m, BLOCK_M)
    rows = pair.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _dot_rows(acc, DPre, rows, live, K, W + e.to(tl.int64) * stride_we, n, n_ok, stride_wn, stride_wk, K,
                    BLOCK_K, UPCAST, PRECISION)
    tl.store(DX + rows[:, None] * N + n[None, :], _round(acc, DX.dtype.element_ty, UPCAST),
             mask=live[:, None] & n_ok[None, :])


@triton.jit
def _weight_grad_kernel(A, B, RouteW, Out, Perm, Bounds, stride_a, stride_b, stride_oe, stride_om, stride_on,
                        top_k, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        A_BY_TOKEN: tl.constexpr, B_BY_TOKEN: tl.constexpr, SCALE_A: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Out_e[m, n] = sum over expert e's pairs p of A[row(p), m] (times p's routing weight with SCALE_A) *
    B[row(p), n]; a row is p's token (BY_TOKEN) or p itself. An expert no pair picked gets zeros."""
    e, pid_m, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    lo = tl.load(Bounds + e)
    count = tl.load(Bounds + e + 1) - lo
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s0 in range(0, count, BLOCK_K):
        s = s0 + tl.arange(0, BLOCK_K)
        s_ok = s < count
        pair = tl.load(Perm + lo + s, mask=s_ok, other=0)
        row_a = (pair // top_k if A_BY_TOKEN else pair).to(tl.int64)
        row_b = (pair // top_k if B_BY_TOKEN else pair).to(tl.int64)
        a = tl.load(A + row_a[:, None] * stride_a + m[None, :], mask=s_ok[:, None] & m_ok[None, :], other=0.0)
        b = tl.load(B + row_b[:, None] * stride_b + n[None, :], mask=s_ok[:, None] & n_ok[None, :], other=0.0)
        if SCALE_A:
            route = tl.load(RouteW + pair, mask=s_ok, other=0.0).to(tl.float32)
            a = _round(a.to(tl.float32) * route[:, None], A.dtype.element_ty, UPCAST)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=PRECISION)
    out = Out + e.to(tl.int64) * stride_oe + m[:, None] * stride_om + n[None, :] * stride_on
    tl.store(out, _round(acc, Out.dtype.element_ty, UPCAST), mask=m_ok[:, None] & n_ok[None, :])


def weight_grad_sizes(dtype: torch.dtype) -> BlockSizes:
    """``_weight_grad_kernel``'s tile: (BLOCK_M, BLOCK_N) of the weight, BLOCK_K pairs per step; fp32 halves it."""
    return BlockSizes(64, 64, 32, num_warps=4) if dtype == torch.float32 else BlockSizes(128, 128, 32, num_warps=8)


def _weight_grad(a, b, route, out, perm, bounds, top_k, a_by_token, b_by_token, scale_a, out_strides, sizes):
    """Launch ``_weight_grad_kernel`` into ``out`` viewed through ``out_strides`` (expert, m, n)."""
    experts = bounds.numel() - 1
    m, n = a.shape[1], b.shape[1]
    grid = (experts, triton.cdiv(m, sizes.block_m), triton.cdiv(n, sizes.block_n))
    _weight_grad_kernel[grid](a, b, route, out, perm, bounds, a.stride(0), b.stride(0), *out_strides, top_k, m, n,
                              BLOCK_M=sizes.block_m, BLOCK_N=sizes.block_n, BLOCK_K=sizes.block_k,
                              A_BY_TOKEN=a_by_token, B_BY_TOKEN=b_by_token, SCALE_A=scale_a, UPCAST=_INTERPRET,
                              PRECISION="ieee" if out.dtype == torch.float32 else None, num_warps=sizes.num_warps,
                              num_stages=sizes.num_stages)


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias,
                layout: ExpertsLayout, sizes: BlockSizes | None):
        fwd = experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, sizes,
                              gate_up_bias=gate_up_bias, down_bias=down_bias, layout=layout, save=True)
        if fwd.routing is None:  # no pairs
            ctx.empty = True
            return fwd.out
        ctx.empty = False
        r = fwd.routing
        ctx.save_for_backward(fwd.x, top_k_index, top_k_weights, gate_up_proj, down_proj, down_bias, fwd.act,
                              fwd.pre, r.perm, r.bounds, r.first_block, r.block_expert)
        ctx.layout, ctx.sizes, ctx.hidden_dtype = layout, fwd.sizes, hidden_states.dtype
        ctx.has_gate_up_bias = gate_up_bias is not None
        return fwd.out

    @staticmethod
    def backward(ctx, dout):
        nothing = (None,) * 9
        if ctx.empty:
            return nothing
        (x, top_k_index, top_k_weights, gate_up_proj, down_proj, down_bias, act, pre, perm, bounds, first_block,
         block_expert) = ctx.saved_tensors
        layout, sizes = ctx.layout, ctx.sizes
        need = ctx.needs_input_grad
        tokens, top_k = top_k_index.shape
        experts, pairs, inter = gate_up_proj.shape[0], act.shape[0], act.shape[1]
        hidden = x.shape[1]
        dtype = gate_up_proj.dtype
        g = dout.to(dtype).contiguous()
        weights = top_k_weights.reshape(-1)
        meta = (perm, bounds, first_block, block_expert)
        nb = block_expert.numel()
        launch = launch_args(sizes, dtype)
        n_tiles = triton.cdiv(inter, sizes.block_n)
        dpre = torch.empty_like(pre)
        droute = torch.empty(pairs, n_tiles, dtype=torch.float32, device=x.device)
        # transformers' layout (E, H, I) read with I as the columns: the transposed strides (and vice versa)
        _act_grad_kernel[(nb, n_tiles)](
            g, down_proj, pre, act, weights, dpre, droute, *meta, g.stride(0),
            *_strides(down_proj, not layout.transposed), experts, top_k, hidden, inter, n_tiles, layout.alpha,
            rounded_limit(layout, dtype), INTERLEAVED=layout.interleaved, GATE=layout.gate, **launch)
        dx = d_route = d_gate_up = d_down = d_gate_up_bias = d_down_bias = None
        if need[0]:
            per_pair = torch.empty(pairs, hidden, dtype=dtype, device=x.device)
            _input_grad_kernel[(nb, triton.cdiv(hidden, sizes.block_n))](
                dpre, gate_up_proj, per_pair, *meta, *_strides(gate_up_proj, not layout.transposed), experts,
                2 * inter, hidden, **launch)
            dx = torch.sum(per_pair.view(tokens, top_k, hidden), dim=1, dtype=torch.float32).to(ctx.hidden_dtype)
        if need[2]:
            d_route = droute.sum(1)
            if down_bias is not None:  # the bias's share of each pair's output: dout[token] . b_e
                d_route = d_route + (g.float() @ down_bias.float().T).gather(1, top_k_index).reshape(-1)
            d_route = d_route.view(tokens, top_k).to(top_k_weights.dtype)
        wsizes = weight_grad_sizes(dtype)
        if need[3]:  # dW_gate_up_e[j, h] = sum dpre[p, j] x[token(p), h]
            d_gate_up = torch.empty_like(gate_up_proj)
            s = d_gate_up.stride()
            _weight_grad(dpre, x, weights, d_gate_up, perm, bounds, top_k, False, True, False,
                         (s[0], s[2], s[1]) if layout.transposed else s, wsizes)
        if need[4]:  # dW_down_e[h, i] = sum w_p dout[token(p), h] act[p, i]
            d_down = torch.empty_like(down_proj)
            s = d_down.stride()
            _weight_grad(g, act, weights, d_down, perm, bounds, top_k, True, False, True,
                         (s[0], s[2], s[1]) if layout.transposed else s, wsizes)
        expert_of_pair = top_k_index.reshape(-1)
        if ctx.has_gate_up_bias and need[5]:
            d_gate_up_bias = torch.zeros(experts, 2 * inter, dtype=torch.float32, device=x.device).index_add_(
                0, expert_of_pair, dpre.float()).to(dtype)
        if down_bias is not None and need[6]:
            weighted = g.float().repeat_interleave(top_k, dim=0) * weights.float()[:, None]
            d_down_bias = torch.zeros(experts, hidden, dtype=torch.float32, device=x.device).index_add_(
                0, expert_of_pair, weighted).to(dtype)
        return dx, None, d_route, d_gate_up, d_down, d_gate_up_bias, d_down_bias, None, None


def experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            gate_up_proj: torch.Tensor, down_proj: torch.Tensor, sizes: BlockSizes | None = None, *,
            gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
            layout: ExpertsLayout | None = None) -> torch.Tensor:
    """``triton_moe.fused_experts``, differentiable w.r.t. the hidden states, the routing weights, the expert
    weights and biases (the arguments and layouts are its; None: the default layout)."""
    return _Experts.apply(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias,
                          down_bias, layout or ExpertsLayout(), sizes)


def module_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """An experts module (one ``moe.unsupported`` passes) through ``experts``, in its layout."""
    layout, gate_up_bias, down_bias = moe.module_layout(module)
    return experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj,
                   gate_up_bias=gate_up_bias, down_bias=down_bias, layout=layout)


def experts_training(model: torch.nn.Module) -> AbstractContextManager:
    """Within the block, ``model``'s supported experts modules run ``module_forward`` on CUDA (forward and
    backward), their own forward elsewhere. Yields how many it switched."""
    return moe.experts_kernels(moe.kernel_modules(model), forward=module_forward)
