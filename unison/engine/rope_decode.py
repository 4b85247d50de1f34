"""A decode step's q/k norms, RoPE, K/V write and paged attention in one kernel (Triton).

In the engine's fused decoder layers (``unison.engine.fused_layer``) a layer's attention was two launches at decode:
``qkv_rope_write`` (normalise and rotate q and k, write k and v into the pool) and the paged decode kernel
(``unison.engine.triton_attention``). At 64 requests on an H200 the first is ~2.7 us a layer (a few KB of work: its
launch, its loads' latency and the drain before the attention may start), ~4% of a 0.6B decode step. Here the
attention's program for (sequence, KV head, split) first does that work for its own heads: the GQA group's query
heads and its key and value head of the step's token. It stores the rotated queries (the attention reloads them in
its own layout; each split its own copy) and, in the split whose keys hold the token's position, the new key and
value at the token's pool slot, waits for its threads (``bar.sync``: a program reads its own global writes after
it), then runs the decode kernel's program as is. No two programs write the same place and no program reads what
another writes, so one launch does it all (and the splits' combine, where there are several).

Each value rounds where the two kernels round (``normed_rope`` is their shared code), both kernels are compiled
without multiply-add contraction, and the q/k norms' rows take ``qkv_rope_write``'s tile (its rows and warps: the
order a head's sum of squares is reduced in), so the output equals the two launches' bit for bit
(tests/test_rope_decode.py; where the tile cannot be that one, ``equals_two_launches`` says no and the backend keeps
the two launches). Decode-only steps take it (the captured decode graphs'); steps with prefill chunks keep the two
launches. On by default (``TritonPagedBackend.rope_decode``; ``UNISON_ROPE_DECODE=0`` for an A/B): on an H200 with
a 4-row tile it took ~28 ms off a 0.6B rollout; with the 8-row tile on two H100s, 0.6B GRPO steps of 1.312-1.315 s
against 1.323-1.325 s on one, 1.357 against 1.366 s (mean of three, noisier) on the other
(bench/results/h100/speed/rope2/README.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import gdc
from .fused_layer import normed_rope, rope_tile, store_rotated
from .triton_attention import LOG2E, combine_splits, decode_program, pipeline_stages, split_buffers, split_range

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["stride_bt"])
def _rope_decode_kernel(QR, KR, VR, QW, KW, Cos, Sin, Slots, QO, K, V, BT, CTX, Out, PO, PML, scale_log2, window,
                        q_heads, k_heads, stride_qr, stride_kr, stride_vr, stride_c, stride_qo, stride_ks, stride_vs,
                        stride_bt, stride_on, stride_oh, eps_q, eps_k, HEADS: tl.constexpr, HALF: tl.constexpr,
                        BLOCK: tl.constexpr, ROWS: tl.constexpr, NORM: tl.constexpr, GROUP: tl.constexpr,
                        BLOCK_G: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                        WINDOWED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    gdc.wait(PDL)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    t = seq.to(tl.int64)  # a decode-only step: token t is sequence t's query
    r = tl.arange(0, ROWS)  # the group's query heads, then the key head; a padding row names no head
    heads = tl.where(r < GROUP, kvh * GROUP + r, tl.where(r == GROUP, q_heads + kvh, q_heads + k_heads))
    out, d, dmask, is_q, is_k, kh = normed_rope(QR, KR, QW, KW, Cos, Sin, t, heads, q_heads, k_heads, stride_qr,
                                                stride_kr, stride_c, eps_q, eps_k, HALF, BLOCK, NORM)
    # Each split keeps its own copy of the queries; the new key and value are written by the split whose keys hold
    # the token's position (ctx - 1), the only one that reads them.
    qo = QO + split * (HEADS * 2 * HALF)
    ctx = tl.load(CTX + seq).to(tl.int32)
    start, end = split_range(ctx, window, split, BLOCK_N, SPLITS, WINDOWED)
    owns = (start < ctx) & (end == ctx)
    store_rotated(out, d, dmask, is_q, tl.where(owns, is_k, False), kh, heads, t, VR, qo, K, V, Slots, stride_vr,
                  stride_qo, stride_ks, stride_vs, HALF)  # (``is_k & owns``: a mask the interpreter rejects)
    tl.debug_barrier()  # the query rows and the new key and value, written above, are read below
    decode_program(qo, K, V, BT, CTX, qo, Out, PO, PML, scale_log2, 1.0, window, stride_qo, 2 * HALF, stride_ks,
                   2 * HALF, stride_vs, 2 * HALF, stride_bt, stride_on, stride_oh, seq, kvh, split, HEADS, GROUP,
                   BLOCK_G, 2 * HALF, BLOCK, 2 * HALF, BLOCK, PAGE, BLOCK_N, SPLITS, WINDOWED, False, False, UPCAST,
                   PRECISION)


def equals_two_launches(heads: int, kv_heads: int, dim: int, num_warps: int = 4) -> bool:
    """Whether the one launch rounds as ``qkv_rope_write`` does at these heads: its program's q/k-norm rows (the GQA
    group and its key head, padded) fit ``qkv_rope_write``'s tile (``rope_tile``) and it runs that tile's warps, so
    each head's sum of squares is reduced in the same order. (A tile of 4 rows against 8 reduced in another order:
    ~1 key element in 10^6 rounded otherwise, and the engine's logprobs parted, bench/results/h100/speed/rope2/
    README.md.) The interpreter reduces in one order whatever the warps."""
    rows, warps = rope_tile(heads, kv_heads, dim)
    return heads // kv_heads + 1 <= rows and (warps == num_warps or _INTERPRET)


def rope_paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                      context_lens: torch.Tensor, block_size: int, scale: float, window: int | None = None,
                      q_norm: torch.nn.Module | None = None, k_norm: torch.nn.Module | None = None, splits: int = 1,
                      block_n: int = 64, num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """``qkv_rope_write`` then ``paged_decode`` in one launch (two with ``splits`` > 1: the splits' combine), for a
    decode-only step: row i of q (B, H, D), k and v (B, KVH, D) (each row's heads contiguous) is sequence i's token,
    at pool slot ``slots[i]`` and position ``context_lens[i] - 1`` (cos, sin: (B, D)); pools (slots, KVH, D)
    contiguous. Returns (B, H, D)."""
    batch, heads, dim = q.shape
    kv_heads = k.shape[1]
    if (heads % kv_heads or dim % 2 or k_pool.shape[1:] != (kv_heads, dim) or v_pool.shape[1:] != (kv_heads, dim)
            or not (k_pool.is_contiguous() and v_pool.is_contiguous())):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, pools {tuple(k_pool.shape)} and "
                         f"{tuple(v_pool.shape)}: not one decode step's heads")
    group = heads // kv_heads
    rows = max(rope_tile(heads, kv_heads, dim)[0], triton.next_power_of_2(group + 1))  # as qkv_rope_write's, if it fits
    norm = q_norm is not None
    q_out = torch.empty(batch, splits, heads, dim, dtype=q.dtype, device=q.device)  # a copy a split
    out = torch.empty(batch, heads, dim, dtype=q.dtype, device=q.device)
    part_o, part_ml = split_buffers(out, splits)
    block = triton.next_power_of_2(dim)
    num_stages = num_stages or pipeline_stages(block_n, dim, dim, k_pool.element_size())
    launch = gdc.launch(q)
    _rope_decode_kernel[(batch, kv_heads, splits)](
        q, k, v, q_norm.weight if norm else q, k_norm.weight if norm else q, cos, sin, slots, q_out, k_pool, v_pool,
        block_tables, context_lens, out, part_o, part_ml, scale * LOG2E, window or 0, heads, kv_heads, q.stride(0),
        k.stride(0), v.stride(0), cos.stride(0), q_out.stride(0), k_pool.stride(0), v_pool.stride(0),
        block_tables.stride(0), out.stride(0), out.stride(1), q_norm.variance_epsilon if norm else 0.0,
        k_norm.variance_epsilon if norm else 0.0, HEADS=heads, HALF=dim // 2, BLOCK=block,
        ROWS=rows, NORM=norm, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        PAGE=block_size, BLOCK_N=block_n, SPLITS=splits, WINDOWED=window is not None, UPCAST=_INTERPRET,
        PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=False, **launch)
    if splits > 1:
        combine_splits(part_o, part_ml, None, out, splits, launch)
    return out
