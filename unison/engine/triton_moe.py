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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter's bf16 dot and cast are wrong: see UPCAST


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


@triton.jit
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
def _gate_up_kernel(X, W, Out, Perm, Bounds, FirstBlock, BlockExpert,
                    stride_xt, stride_we, stride_wn, stride_wk, stride_os,
                    num_experts, top_k, K, N,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                    PRECISION: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    if e >= num_experts:
        return
    pair, live = _block_rows(Perm, Bounds, FirstBlock, e, pid_m, BLOCK_M)
    token = (pair // top_k).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N  # N: the intermediate width; gate rows n, up rows N + n
    w_base = W + e.to(tl.int64) * stride_we
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
    dtype = Out.dtype.element_ty
    gate = _round(acc_gate, dtype, UPCAST).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), dtype, UPCAST)  # SiLU as torch computes it, rounded as its output
    hidden = _round(act.to(tl.float32) * _round(acc_up, dtype, UPCAST).to(tl.float32), dtype, UPCAST)
    tl.store(Out + pair.to(tl.int64)[:, None] * stride_os + n[None, :], hidden, mask=live[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(A, W, RouteW, Out, Perm, Bounds, FirstBlock, BlockExpert,
                 stride_as, stride_we, stride_wn, stride_wk, stride_os,
                 num_experts, N, K,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                 PRECISION: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    if e >= num_experts:
        return
    pair, live = _block_rows(Perm, Bounds, FirstBlock, e, pid_m, BLOCK_M)
    rows = pair.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N  # N: the hidden width
    w_base = W + e.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K: the intermediate width
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(A + rows[:, None] * stride_as + k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + n[None, :] * stride_wn + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    proj = _round(acc, W.dtype.element_ty, UPCAST).to(tl.float32)
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


def fused_experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  gate_up_proj: torch.Tensor, down_proj: torch.Tensor, sizes: BlockSizes | None = None) -> torch.Tensor:
    """sum_k w[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = top_k_index[t, k], in two kernels.

    hidden_states: (T, H); top_k_index: (T, K) int; top_k_weights: (T, K); gate_up_proj: (E, 2I, H) (gate rows
    first); down_proj: (E, H, I), transformers' non-transposed layout, read in place. Returns (T, H) in the
    hidden states' dtype."""
    tokens, top_k = top_k_index.shape
    experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    if down_proj.shape != (experts, hidden, inter) or hidden_states.shape != (tokens, hidden):
        raise ValueError(f"fused_experts: hidden {tuple(hidden_states.shape)}, gate_up {tuple(gate_up_proj.shape)} "
                         f"and down {tuple(down_proj.shape)} do not make one experts layer")
    dtype = gate_up_proj.dtype
    x = hidden_states.to(dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    pairs = tokens * top_k
    if pairs == 0:
        return hidden_states.new_zeros(tokens, hidden)
    sizes = sizes or block_sizes(pairs, experts, dtype)
    routing = align(top_k_index, experts, sizes.block_m)
    weights = top_k_weights.reshape(-1)
    nb = routing.block_expert.numel()
    precision = "ieee" if dtype == torch.float32 else None  # fp32 weights: exact fp32 products, never TF32
    launch = dict(BLOCK_M=sizes.block_m, BLOCK_N=sizes.block_n, BLOCK_K=sizes.block_k, UPCAST=_INTERPRET,
                  PRECISION=precision, num_warps=sizes.num_warps, num_stages=sizes.num_stages)
    meta = (routing.perm, routing.bounds, routing.first_block, routing.block_expert)
    act = torch.empty(pairs, inter, dtype=dtype, device=x.device)
    _gate_up_kernel[(nb, triton.cdiv(inter, sizes.block_n))](
        x, gate_up_proj, act, *meta, x.stride(0), *gate_up_proj.stride(), act.stride(0),
        experts, top_k, hidden, inter, **launch)
    per_pair = torch.empty(pairs, hidden, dtype=torch.promote_types(dtype, weights.dtype), device=x.device)
    _down_kernel[(nb, triton.cdiv(hidden, sizes.block_n))](
        act, down_proj, weights, per_pair, *meta, act.stride(0), *down_proj.stride(), per_pair.stride(0),
        experts, hidden, inter, **launch)
    return per_pair.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


def experts_reference(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      gate_up_proj: torch.Tensor, down_proj: torch.Tensor, block_m: int = 16) -> torch.Tensor:
    """What ``fused_experts`` computes, in PyTorch: block by block over ``align_reference``, fp32 products rounded
    where the kernels round. Raises AssertionError if the blocks do not cover every pair exactly once."""
    tokens, top_k = top_k_index.shape
    experts, two_i, hidden = gate_up_proj.shape
    inter, dtype = two_i // 2, gate_up_proj.dtype
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
        rows = x[pair // top_k].float()
        gate = (rows @ gate_up_proj[e, :inter].float().T).to(dtype).float()
        up = (rows @ gate_up_proj[e, inter:].float().T).to(dtype).float()
        act = (gate / (1 + torch.exp(-gate))).to(dtype).float()
        mid = (act * up).to(dtype).float()
        proj = (mid @ down_proj[e].float().T).to(dtype).float()
        per_pair[pair] = (proj * weights[pair].float()[:, None]).to(out_dtype)
    assert bool((seen == 1).all()), f"blocks cover pairs {seen.tolist()} times, not once each"
    return per_pair.view(tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)
