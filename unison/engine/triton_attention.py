"""Paged decode attention in Triton: one query token per sequence, its context read from the block pool.

One program per (sequence, KV head, split): it loads the query rows of every head that shares the KV head (GQA),
so each K/V tile is read from memory once for the whole group, and runs an online softmax over its share of the
context. With more than one split ("flash decoding"), each program writes an unnormalised partial and a second
kernel combines them; splits keep the GPU busy when there are few sequences and long contexts. The grid depends
only on the batch size and the split count, never on the context lengths, which are read on the device: so
the launch can be captured in a CUDA graph once and replayed as the contexts grow.

Under ``TRITON_INTERPRET=1`` (CPU) the same kernels run in Triton's interpreter; they then upcast to fp32 for
the dot products, because the interpreter's bf16 dot is wrong.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634


@triton.jit
def _tile(q, K, V, BT, bt_base, kvh, n0, end, m, denom, acc, scale_log2, stride_ks, stride_kh, stride_vs, stride_vh,
          dmask, d, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Online-softmax update of (m, denom, acc) with keys n0 .. n0 + BLOCK_N - 1 (those below ``end``)."""
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < end
    page = tl.load(BT + bt_base + n // PAGE, mask=nmask, other=0)
    slot = page.to(tl.int64) * PAGE + n % PAGE
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_G, BLOCK_N), log2 units
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # finite: the tile holds at least key n0
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


@triton.jit
def _decode_kernel(Q, K, V, BT, CTX, Out, PO, PML, scale_log2, window,
                   stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_on, stride_oh,
                   HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                   WINDOWED: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CTX + seq).to(tl.int32)  # keys 0 .. ctx-1; the query sits at position ctx-1
    lo = 0
    if WINDOWED:
        lo = tl.maximum(ctx - window, 0)
    per = tl.cdiv(tl.cdiv(ctx - lo, SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per
    end = tl.minimum(start + per, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    qo_mask = gmask[:, None] & dmask[None, :]
    q = tl.load(Q + seq * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=qo_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    kv_base = seq * stride_bt
    if UPCAST:  # the interpreter cannot take a tensor-bounded range(); a while loop is not pipelined when compiled
        n0 = start
        while n0 < end:
            m, denom, acc = _tile(q, K, V, BT, kv_base, kvh, n0, end, m, denom, acc, scale_log2, stride_ks, stride_kh,
                              stride_vs, stride_vh, dmask, d, PAGE, BLOCK_N, UPCAST, PRECISION)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m, denom, acc = _tile(q, K, V, BT, kv_base, kvh, n0, end, m, denom, acc, scale_log2, stride_ks, stride_kh,
                              stride_vs, stride_vh, dmask, d, PAGE, BLOCK_N, UPCAST, PRECISION)

    if SPLITS == 1:
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(Out + seq * stride_on + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                 mask=qo_mask)
    else:  # unnormalised partial; an empty split leaves m = -inf, denom = 0, acc = 0
        row = (seq * HEADS + heads) * SPLITS + split
        tl.store(PO + row[:, None] * BLOCK_D + d[None, :], acc, mask=qo_mask)
        tl.store(PML + row * 2, m, mask=gmask)
        tl.store(PML + row * 2 + 1, denom, mask=gmask)


@triton.jit
def _combine_kernel(PO, PML, Out, stride_on, stride_oh, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < SPLITS
    row = (seq * HEADS + head) * SPLITS + s
    m = tl.load(PML + row * 2, mask=smask, other=float("-inf"))
    denom = tl.load(PML + row * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(denom > 0, tl.exp2(m - m_max), 0.0)
    acc = tl.load(PO + row[:, None] * BLOCK_D + d[None, :], mask=smask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(denom * w, 0)
    tl.store(Out + seq * stride_on + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scale: float, window: int | None = None,
                 splits: int = 1, block_n: int = 64, num_warps: int = 4, num_stages: int = 2,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q: (B, H, D); k_pool, v_pool: (slots, KVH, D) with slot = block * block_size + offset; block_tables: (B, W)
    int32/int64 (row b lists sequence b's blocks, at least ceil(context_lens[b] / block_size) of them);
    context_lens: (B,) >= 1, the query's own key included. Returns (B, H, D) in q's dtype (``out`` if given).
    fp32 inputs take IEEE fp32 dot products, not TF32.
    """
    batch, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("paged_decode needs the head dimension contiguous")
    group = heads // kv_heads
    block_d = triton.next_power_of_2(head_dim)
    out = torch.empty_like(q) if out is None else out
    if splits > 1:
        part_o = torch.empty(batch * heads * splits * block_d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch * heads * splits * 2, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # unused
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_pool, v_pool, block_tables, context_lens, out, part_o, part_ml, scale * LOG2E, window or 0,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_D=block_d, PAGE=block_size, BLOCK_N=block_n, SPLITS=splits, WINDOWED=window is not None,
        UPCAST=_INTERPRET, PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=num_warps,
        num_stages=num_stages)
    if splits > 1:
        _combine_kernel[(batch, heads)](part_o, part_ml, out, out.stride(0), out.stride(1), HEADS=heads,
                                        HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=splits,
                                        BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return out


def num_splits(batch: int, kv_heads: int, max_context: int, multiprocessors: int, block_n: int = 64) -> int:
    """Splits per (sequence, KV head): enough programs for about four per multiprocessor, at most one split per
    ``4 * block_n`` keys of the longest context, a power of two, at most 64."""
    want = -(-4 * multiprocessors // (batch * kv_heads))
    cap = max(1, -(-max_context // (4 * block_n)))
    return min(triton.next_power_of_2(max(1, min(want, cap))), 64)
