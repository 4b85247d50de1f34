"""Paged decode attention in Triton: one query token per sequence, its context read from the block pool.

One program per (sequence, KV head, split): it loads the query rows of every head that shares the KV head (GQA),
so each K/V tile is read from memory once for the whole group, and runs an online softmax over its share of the
context. With more than one split ("flash decoding"), each program writes an unnormalised partial and a second
kernel combines them; splits keep the GPU busy when there are few sequences and long contexts. The grid depends
only on the batch size and the split count, never on the context lengths, which are read on the device: so
the launch can be captured in a CUDA graph once and replayed as the contexts grow.

``decode_program`` is one program's work; ``unison.engine.rope_decode`` runs it after writing the step's own key and
value. Compiled without multiply-add contraction, as that kernel is, so the two agree bit for bit.

Under ``TRITON_INTERPRET=1`` (CPU) the same kernels run in Triton's interpreter; they then upcast to fp32 for
the dot products, because the interpreter's bf16 dot is wrong.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import gdc

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # a compiled kernel reads only constexpr globals


@triton.jit
def _tile(q, K, V, BT, bt_base, kvh, n0, end, m, denom, acc, scale_log2, cap_log2, stride_ks, stride_kh, stride_vs,
          stride_vh, dk, dkmask, dv, dvmask, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
          UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Online-softmax update of (m, denom, acc) with keys n0 .. n0 + BLOCK_N - 1 (those below ``end``)."""
    n = n0 + tl.arange(0, BLOCK_N)
    nmask = n < end
    page = tl.load(BT + bt_base + n // PAGE, mask=nmask, other=0)
    slot = page.to(tl.int64) * PAGE + n % PAGE
    k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + dk[None, :], mask=nmask[:, None] & dkmask[None, :],
                other=0.0)
    v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + dv[None, :], mask=nmask[:, None] & dvmask[None, :],
                other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # (BLOCK_G, BLOCK_N), log2 units
    if SOFTCAP:  # softcap * tanh(s / softcap) in log2 units; tanh through exp (the interpreter has no tanh)
        s = cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * (s / cap_log2)) + 1.0))
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))  # finite: the tile holds at least key n0
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    denom = denom * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, denom, acc


# The block tables' width changes from step to step (it follows the longest context): never specialised on, so a
# new width reuses the compiled kernel. SPLITS stays a constant: as a run-time value it measured 19.2 against 18.6 us
# a call at 64 x 320 keys, inside the unchanged kernel's spread, so it was not changed on that evidence.
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(Q, K, V, BT, CTX, SINK, Out, PO, PML, scale_log2, cap_log2, window,
                   stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_on, stride_oh,
                   HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, K_DIM: tl.constexpr,
                   BLOCK_DK: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, WINDOWED: tl.constexpr, SINKS: tl.constexpr,
                   SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    gdc.wait(PDL)
    decode_program(Q, K, V, BT, CTX, SINK, Out, PO, PML, scale_log2, cap_log2, window, stride_qn, stride_qh,
                   stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_on, stride_oh, tl.program_id(0),
                   tl.program_id(1), tl.program_id(2), HEADS, GROUP, BLOCK_G, K_DIM, BLOCK_DK, V_DIM, BLOCK_DV, PAGE,
                   BLOCK_N, SPLITS, WINDOWED, SINKS, SOFTCAP, UPCAST, PRECISION)


@triton.jit
def split_range(ctx, window, split, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, WINDOWED: tl.constexpr):
    """Keys start .. end - 1 of a context of ``ctx`` keys (the window's last ``window`` where WINDOWED) that split
    ``split`` of SPLITS attends to: whole BLOCK_N tiles each, the last split's share shorter or empty."""
    lo = 0
    if WINDOWED:
        lo = tl.maximum(ctx - window, 0)
    per = tl.cdiv(tl.cdiv(ctx - lo, SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per
    return start, tl.minimum(start + per, ctx)


@triton.jit
def decode_program(Q, K, V, BT, CTX, SINK, Out, PO, PML, scale_log2, cap_log2, window, stride_qn, stride_qh,
                   stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_on, stride_oh, seq, kvh, split,
                   HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, K_DIM: tl.constexpr,
                   BLOCK_DK: tl.constexpr, V_DIM: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, WINDOWED: tl.constexpr, SINKS: tl.constexpr,
                   SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Program (seq, kvh, split) of the decode kernel: its GQA group's queries over its share of the context."""
    ctx = tl.load(CTX + seq).to(tl.int32)  # keys 0 .. ctx-1; the query sits at position ctx-1
    start, end = split_range(ctx, window, split, BLOCK_N, SPLITS, WINDOWED)

    g = tl.arange(0, BLOCK_G)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dkmask = dk < K_DIM
    dvmask = dv < V_DIM
    q = tl.load(Q + seq * stride_qn + heads[:, None] * stride_qh + dk[None, :], mask=gmask[:, None] & dkmask[None, :],
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    kv_base = seq * stride_bt
    if UPCAST:  # the interpreter cannot take a tensor-bounded range(); a while loop is not pipelined when compiled
        n0 = start
        while n0 < end:
            m, denom, acc = _tile(q, K, V, BT, kv_base, kvh, n0, end, m, denom, acc, scale_log2, cap_log2, stride_ks,
                                  stride_kh, stride_vs, stride_vh, dk, dkmask, dv, dvmask, PAGE, BLOCK_N, SOFTCAP,
                                  UPCAST, PRECISION)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            m, denom, acc = _tile(q, K, V, BT, kv_base, kvh, n0, end, m, denom, acc, scale_log2, cap_log2, stride_ks,
                                  stride_kh, stride_vs, stride_vh, dk, dkmask, dv, dvmask, PAGE, BLOCK_N, SOFTCAP,
                                  UPCAST, PRECISION)

    o_mask = gmask[:, None] & dvmask[None, :]
    if SPLITS == 1:
        if SINKS:  # the sink joins the softmax's denominator (log2 units), rescaled to a common maximum
            sink = tl.load(SINK + heads, mask=gmask, other=0.0).to(tl.float32) * _LOG2E
            top = tl.maximum(m, sink)
            alpha = tl.exp2(m - top)
            acc = acc * alpha[:, None]
            denom = denom * alpha + tl.exp2(sink - top)
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(Out + seq * stride_on + heads[:, None] * stride_oh + dv[None, :], out.to(Out.dtype.element_ty),
                 mask=o_mask)
    else:  # unnormalised partial; an empty split leaves m = -inf, denom = 0, acc = 0
        row = (seq * HEADS + heads) * SPLITS + split
        tl.store(PO + row[:, None] * BLOCK_DV + dv[None, :], acc, mask=o_mask)
        tl.store(PML + row * 2, m, mask=gmask)
        tl.store(PML + row * 2 + 1, denom, mask=gmask)


@triton.jit
def _combine_kernel(PO, PML, SINK, Out, stride_on, stride_oh, HEADS: tl.constexpr, V_DIM: tl.constexpr,
                    BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr,
                    PDL: tl.constexpr):
    gdc.wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_DV)
    smask = s < SPLITS
    row = (seq * HEADS + head) * SPLITS + s
    m = tl.load(PML + row * 2, mask=smask, other=float("-inf"))
    denom = tl.load(PML + row * 2 + 1, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(SINK + head).to(tl.float32) * _LOG2E
        m_max = tl.maximum(m_max, sink)
    w = tl.where(denom > 0, tl.exp2(m - m_max), 0.0)
    acc = tl.load(PO + row[:, None] * BLOCK_DV + d[None, :], mask=smask[:, None] & (d < V_DIM)[None, :], other=0.0)
    total = tl.sum(denom * w, 0)
    if SINKS:
        total += tl.exp2(sink - m_max)
    out = tl.sum(acc * w[:, None], 0) / total
    tl.store(Out + seq * stride_on + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < V_DIM)


STAGE_BYTES = 128 * 1024
"""Shared memory that three pipeline stages of K/V tiles may take: 3 stages measured faster than 2 at every case of
bench/decode_kernel.py at 128-wide bf16 heads (3 x 32 KiB); wider or fp32 tiles keep 2, as measured before."""


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, block_size: int, scale: float, window: int | None = None,
                 splits: int = 1, block_n: int = 64, num_warps: int = 4, num_stages: int | None = None,
                 out: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    q: (B, H, Dk); k_pool: (slots, KVH, Dk), v_pool: (slots, KVH, Dv) with slot = block * block_size + offset
    (Dk != Dv for multi-head latent attention); block_tables: (B, W) int32/int64 (row b lists sequence b's
    blocks, at least ceil(context_lens[b] / block_size) of them); context_lens: (B,) >= 1, the query's own key
    included; sinks: (H,) attention sinks (one logit per head joins each softmax) or None; softcap: attention
    logit softcapping (``softcap * tanh(s / softcap)``) or None. Returns (B, H, Dv) in q's dtype (``out`` if
    given). fp32 inputs take IEEE fp32 dot products, not TF32. ``num_stages``: the loads' pipeline depth; None:
    3 where three stages of K/V tiles take at most ``STAGE_BYTES``, else 2.
    """
    batch, heads, k_dim = q.shape
    kv_heads, v_dim = k_pool.shape[1], v_pool.shape[-1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    if q.stride(-1) != 1 or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError("paged_decode needs the head dimension contiguous")
    if k_pool.shape[-1] != k_dim:
        raise ValueError(f"queries {k_dim} wide, keys {k_pool.shape[-1]}")
    if sinks is not None and sinks.shape != (heads,):
        raise ValueError(f"sinks of shape {tuple(sinks.shape)} for {heads} heads")
    group = heads // kv_heads
    block_dv = triton.next_power_of_2(v_dim)
    out = q.new_empty(batch, heads, v_dim) if out is None else out
    num_stages = num_stages or pipeline_stages(block_n, k_dim, v_dim, k_pool.element_size())
    part_o, part_ml = split_buffers(out, splits)
    sink_arg = sinks if sinks is not None else out  # unused without sinks
    launch = gdc.launch(q)
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_pool, v_pool, block_tables, context_lens, sink_arg, out, part_o, part_ml, scale * LOG2E,
        (softcap or 1.0) * LOG2E, window or 0, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), K_DIM=k_dim,
        BLOCK_DK=triton.next_power_of_2(k_dim), V_DIM=v_dim, BLOCK_DV=block_dv, PAGE=block_size, BLOCK_N=block_n,
        SPLITS=splits, WINDOWED=window is not None, SINKS=sinks is not None, SOFTCAP=softcap is not None,
        UPCAST=_INTERPRET, PRECISION="ieee" if q.dtype == torch.float32 else None, num_warps=num_warps,
        num_stages=num_stages, enable_fp_fusion=False, **launch)  # as unison.engine.rope_decode's, bit for bit
    if splits > 1:
        combine_splits(part_o, part_ml, sinks, out, splits, launch)
    return out


def split_buffers(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' unnormalised partial outputs and their (max, sum) pairs, fp32, for ``out`` (B, H, Dv); with one
    split, ``out`` twice (unused)."""
    if splits == 1:
        return out, out
    batch, heads, v_dim = out.shape
    rows = batch * heads * splits
    return (torch.empty(rows * triton.next_power_of_2(v_dim), dtype=torch.float32, device=out.device),
            torch.empty(rows * 2, dtype=torch.float32, device=out.device))


def combine_splits(part_o: torch.Tensor, part_ml: torch.Tensor, sinks: torch.Tensor | None, out: torch.Tensor,
                   splits: int, launch: dict) -> None:
    """``out`` (B, H, Dv) from the splits' partials (``split_buffers``), the sinks joining each softmax."""
    batch, heads, v_dim = out.shape
    _combine_kernel[(batch, heads)](part_o, part_ml, sinks if sinks is not None else out, out, out.stride(0),
                                    out.stride(1), HEADS=heads, V_DIM=v_dim, BLOCK_DV=triton.next_power_of_2(v_dim),
                                    SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)),
                                    SINKS=sinks is not None, **launch)


def pipeline_stages(block_n: int, k_dim: int, v_dim: int, element_size: int) -> int:
    """3 where three stages of a key tile and a value tile fit in ``STAGE_BYTES``, else 2."""
    tile = block_n * (triton.next_power_of_2(k_dim) + triton.next_power_of_2(v_dim)) * element_size
    return 3 if 3 * tile <= STAGE_BYTES else 2


def num_splits(batch: int, kv_heads: int, max_context: int, multiprocessors: int, block_n: int = 64) -> int:
    """Splits per (sequence, KV head): none where the grid has three programs per multiprocessor already, else
    enough for about four per multiprocessor, at most one split per ``4 * block_n`` keys of the longest context, a
    power of two, at most 64. At 64 sequences x 8 KV heads on an H200 (132 multiprocessors) one split was faster
    than two at every context from 192 to 4096 keys (bench/results/h200/speed/layers); at 8 x 8, sixteen were
    2.4x faster than one at 4096 keys (bench/results/h200/decode_kernel.json)."""
    programs = batch * kv_heads
    if programs >= 3 * multiprocessors:
        return 1
    want = -(-4 * multiprocessors // programs)
    cap = max(1, -(-max_context // (4 * block_n)))
    return min(triton.next_power_of_2(max(1, min(want, cap))), 64)
