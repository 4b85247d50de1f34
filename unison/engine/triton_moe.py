"""A mixture-of-experts layer's experts in two Triton kernels, the routing permutation folded into their loads.

transformers' ``grouped_mm`` path sorts the T*K (token, expert) pairs, gathers the sorted rows, runs two grouped
GEMMs and scatters the rows back (61% of a Qwen3-30B-A3B-shape decode step on one H200, the GEMMs at ~67% of copy
bandwidth, ~1.1 ms per step in the permutation: bench/results/h200/moe_decode). Here the pairs are sorted once
(``align``) and each kernel program takes one block of BLOCK_M pairs of one expert: it gathers their token rows
itself, multiplies them by one N-tile of that expert's weights (read in place, transformers' layout), and writes
each pair's row by pair index, so nothing is permuted back. Every tensor's shape depends on T, K and E only,
never on the routing: the grid is the upper bound cdiv(T*K, BLOCK_M) + min(E, T*K) blocks and the blocks past
the live count exit at once, so the path has no host sync and CUDA graphs capture it.

0. ``_routing_kernel`` (one program, after torch's sort): each expert's bounds in the sorted order, its blocks.
1. ``_gate_up_kernel``: act(x W_gate^T) * (x W_up^T) of each pair, (S, I) in the weights' dtype.
2. ``_down_kernel``: that times W_down^T, times the pair's routing weight, (S, H) per pair.
Then the sum over the top-k in fp32 (torch's, as transformers does it: deterministic, no atomics).

Rounding follows ``grouped_mm_experts_forward`` step by step: fp32 accumulation, each GEMM's output rounded to the
weights' dtype, SiLU and the gate product rounded to it, the routing weight applied in the promoted dtype.

``ExpertsLayout`` covers GptOss's experts too: weights transposed ((E, H, 2I) and (E, I, H): only the strides'
order changes), gate and up interleaved (gate column 2n, up 2n+1: one tile of adjacent columns, split in
registers), biases (added to each GEMM's rounded output and rounded again, as ``out.add_(bias)``) and its clamped
SwiGLU (``GptOssExperts._apply_gate``, each torch op's rounding kept).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter's bf16 dot and cast are wrong: see UPCAST


@dataclass(frozen=True)
class ExpertsLayout:
    """How an experts module stores its weights and combines gate and up, in transformers' flags."""

    transposed: bool = False
    # gate_up_proj (E, H, 2I) and down_proj (E, I, H) (``is_transposed``), not (E, 2I, H) and (E, H, I)
    interleaved: bool = False
    # gate and up alternate along 2I (gate 2n, up 2n+1; ``is_concatenated=False``), not the gate half first
    gate: str = "silu"
    # "silu": silu(gate) * up (transformers' default ``_apply_gate``); "gptoss": GptOss's, with alpha and limit:
    # gate clamped to <= limit, up to [-limit, limit], (up + 1) * gate * sigmoid(gate * alpha)
    alpha: float = 1.0
    limit: float = 0.0


GATES = ("silu", "gptoss")


@dataclass(frozen=True)
class Routing:
    """The T*K pairs grouped by expert, each expert's group cut into blocks of ``block_m`` pairs."""

    perm: torch.Tensor  # (S,) int64: the pair index (token * K + slot) at each position of the expert-sorted order
    bounds: torch.Tensor  # (E+1,) int64: expert e's pairs are sorted positions bounds[e]..bounds[e+1]-1
    first_block: torch.Tensor  # (E,) int64: expert e's first block
    block_expert: torch.Tensor  # (NB,) int64: each block's expert; E for the blocks past the live count
    block_m: int


def num_blocks(pairs: int, experts: int, block_m: int) -> int:
    """Blocks in the grid: every expert's group padded to a multiple of block_m fits in this many, whatever the
    routing (each hit expert wastes less than one block; at most min(E, S) experts are hit)."""
    return -(-pairs // block_m) + min(experts, pairs)


def align(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """Sort the pairs of ``top_k_index`` (T, K) by expert, with device ops only (no host sync): torch's sort for
    the permutation, then one single-program kernel for the experts' bounds and the blocks' experts (eight small
    torch ops in ``align_reference``, launches paid by every MoE layer of every decode step). Expert ids must be in
    [0, num_experts)."""
    flat = top_k_index.reshape(-1)
    perm = torch.sort(flat, stable=True).indices
    nb = num_blocks(flat.numel(), num_experts, block_m)
    bounds = torch.empty(num_experts + 1, dtype=torch.int64, device=flat.device)
    first_block = torch.empty(num_experts, dtype=torch.int64, device=flat.device)
    block_expert = torch.empty(nb, dtype=torch.int64, device=flat.device)
    block_e = triton.next_power_of_2(num_experts)
    _routing_kernel[(1,)](flat, bounds, first_block, block_expert, flat.numel(), num_experts, nb, BLOCK_M=block_m,
                          BLOCK_E=block_e, BLOCK_S=1024, BLOCK_B=max(16, 8192 // block_e))
    return Routing(perm, bounds, first_block, block_expert, block_m)


def align_reference(top_k_index: torch.Tensor, num_experts: int, block_m: int) -> Routing:
    """``align`` in torch ops."""
    flat = top_k_index.reshape(-1)
    sorted_experts, perm = torch.sort(flat, stable=True)
    dev = flat.device
    bounds = torch.searchsorted(sorted_experts, torch.arange(num_experts + 1, device=dev, dtype=flat.dtype))
    blocks = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    nb = num_blocks(flat.numel(), num_experts, block_m)
    block_expert = torch.searchsorted(block_end, torch.arange(nb, device=dev, dtype=block_end.dtype), right=True)
    return Routing(perm, bounds, block_end - blocks, block_expert, block_m)


@triton.jit(do_not_specialize=["pairs", "num_blocks"])  # they follow the step's token count: one variant
def _routing_kernel(Ids, Bounds, FirstBlock, BlockExpert, pairs, num_experts, num_blocks,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: each expert's pair count, its first sorted position, its first block; each block's expert."""
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for s0 in range(0, pairs, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        ids = tl.load(Ids + s, mask=s < pairs, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=s < pairs)
    e = tl.arange(0, BLOCK_E)
    real = e < num_experts
    tl.store(Bounds + e, (tl.cumsum(counts, 0) - counts).to(tl.int64), mask=real)
    tl.store(Bounds + num_experts, tl.sum(counts, 0).to(tl.int64))  # = pairs
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    tl.store(FirstBlock + e, (block_end - blocks).to(tl.int64), mask=real)
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        # block b's expert: how many experts end at or before it (num_experts for the blocks past the live count)
        ended = (block_end[None, :] <= b[:, None]) & real[None, :]
        tl.store(BlockExpert + b, tl.sum(ended.to(tl.int32), axis=1).to(tl.int64), mask=b < num_blocks)


@triton.jit
def _round(x, dtype: tl.constexpr, UPCAST: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` to nearest even, as the GPU and torch round; the interpreter's bf16 cast
    truncates, so there the rounding is done on the bits (finite values)."""
    if UPCAST and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)


@triton.jit
def _block_rows(Perm, Bounds, FirstBlock, e, pid_m, BLOCK_M: tl.constexpr):
    """The pair indices of block ``pid_m`` (of expert ``e``) and which of its BLOCK_M rows are live."""
    lo = tl.load(Bounds + e) + (pid_m - tl.load(FirstBlock + e)) * BLOCK_M
    hi = tl.load(Bounds + e + 1)
    idx = lo + tl.arange(0, BLOCK_M)
    live = idx < hi
    pair = tl.load(Perm + idx, mask=live, other=0)
    return pair, live


@triton.jit
def _dot_rows(acc, X, rows, live, stride_x, w_base, col, col_ok, stride_wn, stride_wk, K,
              BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """acc + X[rows] W[:, col] over the K inputs: W's column c, input k at w_base + c * stride_wn + k * stride_wk."""
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(X + rows[:, None] * stride_x + k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + col[None, :] * stride_wn + k[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gated(gate, up, alpha, limit, dtype: tl.constexpr, GATE: tl.constexpr, UPCAST: tl.constexpr):
    """The gate applied to fp32 ``gate`` and ``up`` (values of ``dtype``), each torch op's result rounded to it."""
    if GATE == "gptoss":  # GptOssExperts._apply_gate; ``limit`` comes rounded to dtype, so the clamps are exact
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                        propagate_nan=tl.PropagateNan.ALL)
        scaled = _round(gate * alpha, dtype, UPCAST).to(tl.float32)
        sig = _round(1.0 / (1.0 + tl.exp(-scaled)), dtype, UPCAST).to(tl.float32)  # sigmoid as torch computes it
        glu = _round(gate * sig, dtype, UPCAST).to(tl.float32)
        return _round(_round(up + 1.0, dtype, UPCAST).to(tl.float32) * glu, dtype, UPCAST)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype, UPCAST)  # SiLU as torch computes it, rounded as its output
    return _round(act.to(tl.float32) * up, dtype, UPCAST)


@triton.jit
def _gate_up_kernel(X, W, Bias, Out, Pre, Perm, Bounds, FirstBlock, BlockExpert,
                    stride_xt, stride_we, stride_wn, stride_wk, stride_be, stride_os,
                    num_experts, top_k, K, N, alpha, limit,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
                    GATE: tl.constexpr, STORE_PRE: tl.constexpr):
    """Out (S, N): the gated product of each pair; with STORE_PRE, Pre (S, 2N) its gate and up values too (the
    rounded GEMM outputs plus bias, in the weights' column order), which the backward differentiates."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    if e >= num_experts:
        return
    pair, live = _block_rows(Perm, Bounds, FirstBlock, e, pid_m, BLOCK_M)
    token = (pair // top_k).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N  # N: the intermediate width
    w_base = W + e.to(tl.int64) * stride_we
    bias_base = Bias + e.to(tl.int64) * stride_be
    dtype = Out.dtype.element_ty
    if INTERLEAVED:  # gate column 2n, up 2n+1: one tile of 2 * BLOCK_N adjacent columns, split after rounding
        col = 2 * pid_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        col_ok = col < 2 * N
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        acc = _dot_rows(acc, X, token, live, stride_xt, w_base, col, col_ok, stride_wn, stride_wk, K,
                        BLOCK_K, UPCAST, PRECISION)
        both = _round(acc, dtype, UPCAST).to(tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_base + col, mask=col_ok, other=0.0).to(tl.float32)
            both = _round(both + bias[None, :], dtype, UPCAST).to(tl.float32)
        if STORE_PRE:
            tl.store(Pre + pair.to(tl.int64)[:, None] * (2 * N) + col[None, :], _round(both, dtype, UPCAST),
                     mask=live[:, None] & col_ok[None, :])
        gate, up = tl.split(tl.reshape(both, (BLOCK_M, BLOCK_N, 2)))
    else:  # gate rows n, up rows N + n
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K: the hidden width
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            x = tl.load(X + token[:, None] * stride_xt + k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            w_gate = tl.load(w_base + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=w_mask, other=0.0)
            w_up = tl.load(w_base + (n[None, :] + N) * stride_wn + k[:, None] * stride_wk, mask=w_mask, other=0.0)
            if UPCAST:
                x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
            acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(x, w_up, acc_up, input_precision=PRECISION)
        gate = _round(acc_gate, dtype, UPCAST).to(tl.float32)
        up = _round(acc_up, dtype, UPCAST).to(tl.float32)
        if HAS_BIAS:
            bias_gate = tl.load(bias_base + n, mask=n_ok, other=0.0).to(tl.float32)
            bias_up = tl.load(bias_base + N + n, mask=n_ok, other=0.0).to(tl.float32)
            gate = _round(gate + bias_gate[None, :], dtype, UPCAST).to(tl.float32)
            up = _round(up + bias_up[None, :], dtype, UPCAST).to(tl.float32)
        if STORE_PRE:
            pre = Pre + pair.to(tl.int64)[:, None] * (2 * N) + n[None, :]
            tl.store(pre, _round(gate, dtype, UPCAST), mask=live[:, None] & n_ok[None, :])
            tl.store(pre + N, _round(up, dtype, UPCAST), mask=live[:, None] & n_ok[None, :])
    hidden = _gated(gate, up, alpha, limit, dtype, GATE, UPCAST)
    tl.store(Out + pair.to(tl.int64)[:, None] * stride_os + n[None, :], hidden, mask=live[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(A, W, Bias, RouteW, Out, Perm, Bounds, FirstBlock, BlockExpert,
                 stride_as, stride_we, stride_wn, stride_wk, stride_be, stride_os,
                 num_experts, N, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    if e >= num_experts:
        return
    pair, live = _block_rows(Perm, Bounds, FirstBlock, e, pid_m, BLOCK_M)
    rows = pair.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N  # N: the hidden width; K: the intermediate width
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _dot_rows(acc, A, rows, live, stride_as, W + e.to(tl.int64) * stride_we, n, n_ok, stride_wn, stride_wk, K,
                    BLOCK_K, UPCAST, PRECISION)
    proj = _round(acc, W.dtype.element_ty, UPCAST).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(Bias + e.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)
        proj = _round(proj + bias[None, :], W.dtype.element_ty, UPCAST).to(tl.float32)
    route = tl.load(RouteW + rows, mask=live, other=0.0).to(tl.float32)
    out = _round(proj * route[:, None], Out.dtype.element_ty, UPCAST)
    tl.store(Out + rows[:, None] * stride_os + n[None, :], out, mask=live[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class BlockSizes:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def block_sizes(pairs: int, experts: int, dtype: torch.dtype = torch.bfloat16) -> BlockSizes:
    """Chosen for Qwen3-30B-A3B's layer (H 2048, I 768, 128 experts, top-8) by shape alone, never by routing. At
    decode (T 64..256: 4-16 pairs per expert on average) BLOCK_M is about twice the mean group, so nearly every hit
    expert is one block and its weights are read once (an expert over BLOCK_M pairs is read once per block);
    memory-bound, the rows wasted in the tensor cores cost nothing. Prefill's fuller groups take 64 rows per block.
    fp32 halves BLOCK_K (shared memory: ~74 KB for the gate and up tiles, compiled for sm_90). Untuned on the GPU:
    bench/moe_decode.py's experts rows are where to tune."""
    per_expert = pairs / experts
    wide = 2 if dtype == torch.float32 else 1
    if per_expert <= 6:
        return BlockSizes(16, 64, 128 // wide)
    if per_expert <= 20:
        return BlockSizes(32, 64, 128 // wide)
    return BlockSizes(64, 128, 64 // wide, num_warps=8)


def experts_shape(gate_up_proj: torch.Tensor, down_proj: torch.Tensor, layout: ExpertsLayout) -> tuple[int, int, int]:
    """(E, H, I) of an experts layer's weights in ``layout``; ValueError if the two do not make one layer."""
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} are not "
                         "3-D expert weights (E, ., .)")
    if layout.transposed:
        experts, hidden, two_i = gate_up_proj.shape
        down = (experts, two_i // 2, hidden)
    else:
        experts, two_i, hidden = gate_up_proj.shape
        down = (experts, hidden, two_i // 2)
    if two_i % 2 or tuple(down_proj.shape) != down:
        raise ValueError(f"gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} are not "
                         f"one experts layer ({'transposed' if layout.transposed else 'transformers default'} layout: "
                         f"down_proj {down} expected)")
    return experts, hidden, two_i // 2


def _strides(weight: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(per expert, per output column, per input) of a 3-D expert weight."""
    s = weight.stride()
    return (s[0], s[2], s[1]) if transposed else s


def _bias(bias: torch.Tensor | None, shape: tuple[int, int], name: str, weight: torch.Tensor):
    """(the bias or a placeholder pointer, its expert stride, whether there is one)."""
    if bias is None:
        return weight, 0, False
    if tuple(bias.shape) != shape:
        raise ValueError(f"fused_experts: {name} is {tuple(bias.shape)}, not {shape}")
    bias = bias if bias.stride(-1) == 1 else bias.contiguous()
    return bias, bias.stride(0), True


def fused_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up_proj: torch.Tensor, down_proj: torch.Tensor, sizes: BlockSizes | None = None, *,
                  gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  layout: ExpertsLayout = ExpertsLayout()) -> torch.Tensor:
    """sum_k w[t, k] * down_e(gate(gate_up_e(x_t))) with e = top_k_index[t, k], in two kernels.

    hidden_states: (T, H); top_k_index: (T, K) int; top_k_weights: (T, K); gate_up_proj: (E, 2I, H) (gate rows
    first), down_proj: (E, H, I), transformers' default layout, or as ``layout`` says ((E, H, 2I) and (E, I, H)
    transposed; gate and up interleaved), read in place; gate_up_bias: (E, 2I) and down_bias: (E, H) or None.
    Returns (T, H) in the hidden states' dtype. Not differentiable (``unison.train.fused_experts`` is)."""
    return experts_forward(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, sizes,
                           gate_up_bias=gate_up_bias, down_bias=down_bias, layout=layout).out


@dataclass(frozen=True)
class Forward:
    """``experts_forward``'s result: the output and, with ``save``, what the backward reads."""

    out: torch.Tensor  # (T, H) in the hidden states' dtype
    x: torch.Tensor  # (T, H) the hidden states in the weights' dtype, contiguous rows
    act: torch.Tensor  # (S, I) each pair's gated product, the down projection's input
    pre: torch.Tensor | None  # (S, 2I) each pair's gate and up values in the weights' column order (``save``)
    routing: Routing | None
    sizes: BlockSizes | None


def experts_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, sizes: BlockSizes | None = None, *,
                    gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                    layout: ExpertsLayout = ExpertsLayout(), save: bool = False) -> Forward:
    """``fused_experts``, keeping its intermediates; ``save`` also writes each pair's gate and up values."""
    if layout.gate not in GATES:
        raise ValueError(f"fused_experts: gate {layout.gate!r} is not one of {GATES}")
    tokens, top_k = top_k_index.shape
    experts, hidden, inter = experts_shape(gate_up_proj, down_proj, layout)
    if hidden_states.shape != (tokens, hidden):
        raise ValueError(f"fused_experts: hidden {tuple(hidden_states.shape)} and top_k_index "
                         f"{tuple(top_k_index.shape)} do not fit weights of hidden width {hidden}")
    gate_up_bias, stride_gb, gate_up_has_bias = _bias(gate_up_bias, (experts, 2 * inter), "gate_up_bias", gate_up_proj)
    down_bias, stride_db, down_has_bias = _bias(down_bias, (experts, hidden), "down_bias", down_proj)
    dtype = gate_up_proj.dtype
    x = hidden_states.to(dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    pairs = tokens * top_k
    act = torch.empty(pairs, inter, dtype=dtype, device=x.device)
    pre = torch.empty(pairs, 2 * inter, dtype=dtype, device=x.device) if save else None
    if pairs == 0:
        return Forward(hidden_states.new_zeros(tokens, hidden), x, act, pre, None, None)
    sizes = sizes or block_sizes(pairs, experts, dtype)
    routing = align(top_k_index, experts, sizes.block_m)
    weights = top_k_weights.reshape(-1)
    nb = routing.block_expert.numel()
    launch = launch_args(sizes, dtype)
    meta = (routing.perm, routing.bounds, routing.first_block, routing.block_expert)
    _gate_up_kernel[(nb, triton.cdiv(inter, sizes.block_n))](
        x, gate_up_proj, gate_up_bias, act, act if pre is None else pre, *meta, x.stride(0),
        *_strides(gate_up_proj, layout.transposed), stride_gb, act.stride(0), experts, top_k, hidden, inter,
        layout.alpha, rounded_limit(layout, dtype), INTERLEAVED=layout.interleaved, HAS_BIAS=gate_up_has_bias,
        GATE=layout.gate, STORE_PRE=save, **launch)
    per_pair = torch.empty(pairs, hidden, dtype=torch.promote_types(dtype, weights.dtype), device=x.device)
    _down_kernel[(nb, triton.cdiv(hidden, sizes.block_n))](
        act, down_proj, down_bias, weights, per_pair, *meta, act.stride(0), *_strides(down_proj, layout.transposed),
        stride_db, per_pair.stride(0), experts, hidden, inter, HAS_BIAS=down_has_bias, **launch)
    out = per_pair.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
    return Forward(out, x, act, pre, routing, sizes)


def launch_args(sizes: BlockSizes, dtype: torch.dtype) -> dict:
    """The kernels' shared launch keywords; fp32 weights take exact fp32 products, never TF32."""
    return dict(BLOCK_M=sizes.block_m, BLOCK_N=sizes.block_n, BLOCK_K=sizes.block_k, UPCAST=_INTERPRET,
                PRECISION="ieee" if dtype == torch.float32 else None, num_warps=sizes.num_warps,
                num_stages=sizes.num_stages)


def rounded_limit(layout: ExpertsLayout, dtype: torch.dtype) -> float:
    """GptOss's clamp limit in the weights' dtype: torch clamps a tensor at the limit rounded to it."""
    return torch.tensor(layout.limit, dtype=dtype).item()


def gate_reference(gate_up: torch.Tensor, layout: ExpertsLayout) -> torch.Tensor:
    """The gate of ``layout`` on rows of ``gate_up`` (S, 2I) of the weights' dtype, in torch ops: (S, I)."""
    gate, up = (gate_up[:, ::2], gate_up[:, 1::2]) if layout.interleaved else gate_up.chunk(2, dim=-1)
    if layout.gate == "gptoss":
        gate, up = gate.clamp(max=layout.limit), up.clamp(-layout.limit, layout.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * layout.alpha))
    return torch.nn.functional.silu(gate) * up


def experts_reference(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      gate_up_proj: torch.Tensor, down_proj: torch.Tensor, block_m: int = 16, *,
                      gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                      layout: ExpertsLayout = ExpertsLayout()) -> torch.Tensor:
    """What ``fused_experts`` computes, in PyTorch: block by block over ``align_reference``, fp32 products rounded
    where the kernels round. Raises AssertionError if the blocks do not cover every pair exactly once."""
    tokens, top_k = top_k_index.shape
    experts, hidden, _ = experts_shape(gate_up_proj, down_proj, layout)
    dtype = gate_up_proj.dtype
    if layout.transposed:  # as (E, 2I, H) and (E, H, I) views
        gate_up_proj, down_proj = gate_up_proj.transpose(1, 2), down_proj.transpose(1, 2)
    x = hidden_states.to(dtype)
    routing = align_reference(top_k_index, experts, block_m)
    weights = top_k_weights.reshape(-1)
    out_dtype = torch.promote_types(dtype, weights.dtype)
    per_pair = torch.full((tokens * top_k, hidden), float("nan"), dtype=out_dtype, device=x.device)
    seen = torch.zeros(tokens * top_k, dtype=torch.int64, device=x.device)
    bounds, first = routing.bounds.tolist(), routing.first_block.tolist()
    for b, e in enumerate(routing.block_expert.tolist()):
        if e >= experts:
            continue
        lo = bounds[e] + (b - first[e]) * block_m
        pair = routing.perm[lo:min(lo + block_m, bounds[e + 1])]
        seen[pair] += 1
        gate_up = (x[pair // top_k].float() @ gate_up_proj[e].float().T).to(dtype)
        if gate_up_bias is not None:
            gate_up.add_(gate_up_bias[e])  # in the weights' dtype, as transformers' out.add_(bias)
        proj = (gate_reference(gate_up, layout).float() @ down_proj[e].float().T).to(dtype)
        if down_bias is not None:
            proj.add_(down_bias[e])
        per_pair[pair] = (proj.float() * weights[pair].float()[:, None]).to(out_dtype)
    assert bool((seen == 1).all()), f"blocks cover pairs {seen.tolist()} times, not once each"
    return per_pair.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
