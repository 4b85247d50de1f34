"""Paged decode attention over an MLA latent cache in Triton (``unison.engine.mla``).

Every query head attends to the same cached row per token, ``[c, k_rot]`` (``R + E`` wide), with the latent
``c`` as its value. The generic kernel (``triton_attention``) would load the row twice, as a key and as a
value, with its width padded to a power of two (576 -> 1024 for DeepSeek). This one loads ``c`` and ``k_rot``
once per tile as two power-of-two blocks and uses ``c`` for both products:

    s = q_c . c^T + q_rot . k_rot^T        acc += softmax(s) . c

One program per (sequence, block of 16 heads, split); splits and their combination as in the generic kernel,
whose combine kernel this reuses. No sliding window, sinks or softcapping (no MLA family has them: the
backend takes the generic kernel for a layer that does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_attention import _INTERPRET, LOG2E, combine_splits, split_buffers, split_range

BLOCK_H = 16


@triton.jit
def _mla_tile(q_c, q_r, KV, BT, bt_base, n0, end, m, denom, acc, scale_log2, stride_s, r, rmask, e, emask,
              R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
              PRECISION: tl.constexpr):
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < end
    page = tl.load(BT + bt_base + n // PAGE, mask=nmask, other=0)
    row = KV + (page.to(tl.int64) * PAGE + n % PAGE)[:, None] * stride_s
    c = tl.load(row + r[None, :], mask=nmask[:, None] & rmask[None, :], other=0.0)  # (BLOCK_N, BLOCK_R)
    k_rot = tl.load(row + R + e[None, :], mask=nmask[:, None] & emask[None, :], other=0.0)
    if UPCAST:
        c = c.to(tl.float32)
        k_rot = k_rot.to(tl.float32)
    s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
    s += tl.dot(q_r, tl.trans(k_rot), input_precision=PRECISION)
    s = tl.where(nmask[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
    return m_new, denom, acc


@triton.jit(do_not_specialize=["stride_bt"])  # as the generic kernel's: any table width, one variant
def _mla_decode_kernel(Q, KV, BT, CTX, Out, PO, PML, scale_log2, stride_qn, stride_qh, stride_s, stride_bt,
                       stride_on, stride_oh, HEADS: tl.constexpr, BLOCK_H: tl.constexpr, R: tl.constexpr,
                       BLOCK_R: tl.constexpr, E: tl.constexpr, BLOCK_E: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    hblock = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CTX + seq).to(tl.int32)
    start, end = split_range(ctx, 0, split, BLOCK_N, SPLITS, False)

    heads = hblock * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < HEADS
    r = tl.arange(0, BLOCK_R)
    rmask = r < R
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    qrow = Q + seq * stride_qn + heads[:, None] * stride_qh
    q_c = tl.load(qrow + r[None, :], mask=hmask[:, None] & rmask[None, :], other=0.0)
    q_r = tl.load(qrow + R + e[None, :], mask=hmask[:, None] & emask[None, :], other=0.0)
    if UPCAST:
        q_c = q_c.to(tl.float32)
        q_r = q_r.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    bt_base = seq * stride_bt
    if UPCAST:  # the interpreter cannot take a tensor-bounded range()
        n0 = start
        while n0 < end:
            m, denom, acc = _mla_tile(q_c, q_r, KV, BT, bt_base, n0, end, m, denom, acc, scale_log2, stride_s, r,
                                      rmask, e, emask, R, PAGE, BLOCK_N, UPCAST, PRECISION)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m, denom, acc = _mla_tile(q_c, q_r, KV, BT, bt_base, n0, end, m, denom, acc, scale_log2, stride_s, r,
                                      rmask, e, emask, R, PAGE, BLOCK_N, UPCAST, PRECISION)

    o_mask = hmask[:, None] & rmask[None, :]
    if SPLITS == 1:
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(Out + seq * stride_on + heads[:, None] * stride_oh + r[None, :], out.to(Out.dtype.element_ty),
                 mask=o_mask)
    else:  # the generic kernel's partial layout, for its combine kernel
        row = (seq * HEADS + heads) * SPLITS + split
        tl.store(PO + row[:, None] * BLOCK_R + r[None, :], acc, mask=o_mask)
        tl.store(PML + row * 2, m, mask=hmask)
        tl.store(PML + row * 2 + 1, denom, mask=hmask)


def is_latent(k_pool: torch.Tensor, v_pool: torch.Tensor) -> bool:
    """Whether ``v_pool`` is the first columns of a one-head ``k_pool`` (an MLA latent cache)."""
    return (k_pool.shape[1] == 1 and v_pool.shape[1] == 1 and v_pool.data_ptr() == k_pool.data_ptr()
            and v_pool.stride() == k_pool.stride() and v_pool.shape[-1] < k_pool.shape[-1])


def head_blocks(heads: int) -> int:
    return -(-heads // BLOCK_H)


def mla_decode(q: torch.Tensor, kv_pool: torch.Tensor, rank: int, block_tables: torch.Tensor,
               context_lens: torch.Tensor, block_size: int, scale: float, splits: int = 1, block_n: int = 32,
               num_warps: int = 4, num_stages: int = 2, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: (B, H, R + E) absorbed queries; kv_pool: (slots, 1, R + E) cached ``[c, k_rot]`` rows (``rank`` = R);
    block_tables, context_lens as ``paged_decode``. Returns (B, H, R): each head's softmax-weighted latents."""
    batch, heads, width = q.shape
    if kv_pool.shape[-1] != width or kv_pool.shape[1] != 1:
        raise ValueError(f"queries {width} wide for a latent pool of shape {tuple(kv_pool.shape)}")
    if q.stride(-1) != 1 or kv_pool.stride(-1) != 1:
        raise ValueError("mla_decode needs the last dimension contiguous")
    rope = width - rank
    block_r = triton.next_power_of_2(rank)
    out = q.new_empty(batch, heads, rank) if out is None else out
    part_o, part_ml = split_buffers(out, splits)
    _mla_decode_kernel[(batch, head_blocks(heads), splits)](
        q, kv_pool, block_tables, context_lens, out, part_o, part_ml, scale * LOG2E, q.stride(0), q.stride(1),
        kv_pool.stride(0), block_tables.stride(0), out.stride(0), out.stride(1), HEADS=heads, BLOCK_H=BLOCK_H,
        R=rank, BLOCK_R=block_r, E=rope, BLOCK_E=max(16, triton.next_power_of_2(rope)), PAGE=block_size,
        BLOCK_N=block_n, SPLITS=splits, UPCAST=_INTERPRET, PRECISION="ieee" if q.dtype == torch.float32 else None,
        num_warps=num_warps, num_stages=num_stages)
    if splits > 1:  # the latent decode kernel before it launches plainly: so does the combine
        combine_splits(part_o, part_ml, None, out, splits, {"PDL": False})
    return out
