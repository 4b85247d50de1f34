"""Layouts of the paged decode kernel tried against the engine's. Time per call over 28 layers' pools in one CUDA
graph, as ``decode_kernel.py --suite short``.

``--set layouts`` (neither kept; bench/results/h200/speed/host_gaps/0_probe/decode_kernel_variants.json): the grid
with the KV heads as its fastest axis (a sequence's eight heads read its 2 KB slot rows together), and two or four
adjacent KV heads per program (their rows contiguous, queries block-diagonal, one wave of programs).

``--set serial`` (not kept; bench/results/h200/speed/attention/variants_serial.json): SER KV heads of a sequence one
after the other in one program's loop, so that each program ramps its loads up once. Predicted from a reading of
the engine's grid as two waves; Nsight Compute then found it one wave already (4 programs a multiprocessor), and
fewer programs were slower at 64 sequences.

    python bench/decode_variants.py --set serial --json variants.json
"""

import argparse
import functools
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
from decode_kernel import DIM, HEADS, KV_HEADS, PAGE, graph_us, pools  # noqa: E402

from unison.engine import gdc  # noqa: E402
from unison.engine.triton_attention import LOG2E, _tile, paged_decode  # noqa: E402


@triton.jit(do_not_specialize=["stride_bt"])
def _swapped(Q, K, V, BT, CTX, Out, scale_log2, stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
             stride_bt, stride_on, stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    gdc.wait(PDL)
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    ctx = tl.load(CTX + seq).to(tl.int32)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < D
    q = tl.load(Q + seq * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for n0 in range(0, ctx, BLOCK_N):
        m, denom, acc = _tile(q, K, V, BT, seq * stride_bt, kvh, n0, ctx, m, denom, acc, scale_log2, 1.0, stride_ks,
                              stride_kh, stride_vs, stride_vh, d, dmask, d, dmask, PAGE, BLOCK_N, False, False, None)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(Out + seq * stride_on + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=gmask[:, None])


@triton.jit(do_not_specialize=["stride_bt"])
def _paired(Q, K, V, BT, CTX, Out, scale_log2, stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
            stride_bt, stride_on, stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
            PAIR: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SEQ_FIRST: tl.constexpr,
            PDL: tl.constexpr):
    """PAIR adjacent KV heads in one program: their K/V rows are contiguous; q block-diagonal over them."""
    gdc.wait(PDL)
    if SEQ_FIRST:
        seq = tl.program_id(0)
        pair = tl.program_id(1)
    else:
        pair = tl.program_id(0)
        seq = tl.program_id(1)
    ctx = tl.load(CTX + seq).to(tl.int32)
    r = tl.arange(0, BLOCK_G)  # rows: PAIR * GROUP query heads
    c = tl.arange(0, PAIR * D)  # columns: PAIR heads' dims
    rmask = r < PAIR * GROUP
    diag = ((r // GROUP)[:, None] == (c // D)[None, :]) & rmask[:, None]
    head0 = pair * PAIR * GROUP
    q = tl.load(Q + seq * stride_qn + (head0 + r)[:, None] * stride_qh + (c % D)[None, :], mask=diag, other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, PAIR * D], tl.float32)
    kv0 = pair * PAIR
    for n0 in range(0, ctx, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < ctx
        page = tl.load(BT + seq * stride_bt + n // PAGE, mask=nmask, other=0)
        slot = page.to(tl.int64) * PAGE + n % PAGE
        k = tl.load(K + slot[:, None] * stride_ks + kv0 * stride_kh + c[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(V + slot[:, None] * stride_vs + kv0 * stride_vh + c[None, :], mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(Out + seq * stride_on + (head0 + r)[:, None] * stride_oh + (c % D)[None, :], out.to(Out.dtype.element_ty),
             mask=diag)


@triton.jit(do_not_specialize=["stride_bt"])
def _serial(Q, K, V, BT, CTX, Out, scale_log2, stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
            stride_bt, stride_on, stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
            SER: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """SER KV heads of one sequence one after the other in one loop over SER x tiles: the loads of the next head's
    first tiles are in flight while this head's last ones are used (one pipeline ramp a program, not one a head),
    and the grid (B x KV_HEADS / SER) fits one wave."""
    gdc.wait(PDL)
    seq = tl.program_id(0)
    kv0 = tl.program_id(1) * SER
    ctx = tl.load(CTX + seq).to(tl.int32)
    tiles = tl.cdiv(ctx, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < GROUP
    dmask = d < D
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for t in range(0, SER * tiles):
        h = t // tiles
        n0 = (t - h * tiles) * BLOCK_N
        heads = (kv0 + h) * GROUP + g
        q = tl.load(Q + seq * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
        m, denom, acc = _tile(q, K, V, BT, seq * stride_bt, kv0 + h, n0, ctx, m, denom, acc, scale_log2, 1.0,
                              stride_ks, stride_kh, stride_vs, stride_vh, d, dmask, d, dmask, PAGE, BLOCK_N, False,
                              False, None)
        if n0 + BLOCK_N >= ctx:  # the head's last tile: its output, then a fresh softmax for the next head
            out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
            tl.store(Out + seq * stride_on + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
                     mask=gmask[:, None])
            m = tl.full([BLOCK_G], float("-inf"), tl.float32)
            denom = tl.zeros([BLOCK_G], tl.float32)
            acc = tl.zeros([BLOCK_G, D], tl.float32)


def swapped(q, k, v, bt, lens, block_n=64, warps=4, stages=3, out=None):
    out = torch.empty_like(q) if out is None else out
    b = q.shape[0]
    _swapped[(KV_HEADS, b)](q, k, v, bt, lens, out, DIM**-0.5 * LOG2E, q.stride(0), q.stride(1), k.stride(0),
                            k.stride(1), v.stride(0), v.stride(1), bt.stride(0), out.stride(0), out.stride(1),
                            GROUP=HEADS // KV_HEADS, BLOCK_G=16, D=DIM, PAGE=PAGE, BLOCK_N=block_n,
                            num_warps=warps, num_stages=stages, **gdc.launch(q))
    return out


def paired(q, k, v, bt, lens, pair=2, block_n=32, warps=4, stages=3, seq_first=False, out=None):
    out = torch.empty_like(q) if out is None else out
    b = q.shape[0]
    grid = (b, KV_HEADS // pair) if seq_first else (KV_HEADS // pair, b)
    _paired[grid](q, k, v, bt, lens, out, DIM**-0.5 * LOG2E, q.stride(0), q.stride(1), k.stride(0),
                  k.stride(1), v.stride(0), v.stride(1), bt.stride(0), out.stride(0), out.stride(1),
                  GROUP=HEADS // KV_HEADS, BLOCK_G=max(16, pair * HEADS // KV_HEADS), D=DIM, PAIR=pair, PAGE=PAGE,
                  BLOCK_N=block_n, SEQ_FIRST=seq_first, num_warps=warps, num_stages=stages, **gdc.launch(q))
    return out


def serial(q, k, v, bt, lens, ser=2, block_n=64, warps=4, stages=3, out=None):
    out = torch.empty_like(q) if out is None else out
    b = q.shape[0]
    _serial[(b, KV_HEADS // ser)](q, k, v, bt, lens, out, DIM**-0.5 * LOG2E, q.stride(0), q.stride(1), k.stride(0),
                                  k.stride(1), v.stride(0), v.stride(1), bt.stride(0), out.stride(0), out.stride(1),
                                  GROUP=HEADS // KV_HEADS, BLOCK_G=16, D=DIM, SER=ser, PAGE=PAGE, BLOCK_N=block_n,
                                  num_warps=warps, num_stages=stages, **gdc.launch(q))
    return out


def engine(q, tables, lens, k, v):
    return paged_decode(q, k, v, tables, lens, PAGE, DIM**-0.5)


def layouts(q, tables, lens) -> dict:
    """The grid reordered and KV heads paired (host_gaps/0_probe)."""
    variants = {}
    for bn, w, st in ((64, 4, 3), (64, 4, 2), (32, 4, 3)):
        variants[f"swapped {bn}/{w}/{st}"] = functools.partial(swapped, q, block_n=bn, warps=w, stages=st,
                                                               bt=tables, lens=lens)
    for pair, bn, w, st, sf in ((2, 32, 4, 3, False), (2, 32, 4, 2, False), (2, 64, 4, 2, False),
                                (2, 32, 8, 3, False), (2, 32, 4, 3, True), (4, 16, 4, 3, False),
                                (4, 32, 4, 2, False), (4, 32, 8, 2, False), (2, 16, 4, 4, False)):
        variants[f"pair{pair}{'s' if sf else ''} {bn}/{w}/{st}"] = functools.partial(
            paired, q, pair=pair, block_n=bn, warps=w, stages=st, seq_first=sf, bt=tables, lens=lens)
    return variants


def serials(q, tables, lens) -> dict:
    """KV heads in series (``_serial``): SER heads a program, tile/warps/stages."""
    variants = {}
    for ser, bn, w, st in ((1, 64, 4, 3), (2, 64, 4, 3), (2, 64, 4, 2), (2, 32, 4, 3), (2, 64, 8, 3), (4, 64, 4, 3),
                           (4, 64, 4, 2), (4, 128, 8, 2), (8, 64, 4, 3), (8, 64, 4, 2)):
        variants[f"serial{ser} {bn}/{w}/{st}"] = functools.partial(serial, q, ser=ser, block_n=bn, warps=w,
                                                                    stages=st, bt=tables, lens=lens)
    return variants


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", choices=("layouts", "serial"), default="serial")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = []
    cases = ((64, 192), (64, 320), (64, 576)) if args.set == "layouts" else (
        (64, 96), (64, 192), (64, 352), (64, 576), (256, 192), (256, 320))
    for batch, ctx in cases:
        layers, q, tables, lens = pools(batch, ctx, 28)
        nbytes = 2 * batch * ctx * KV_HEADS * DIM * 2
        ref = paged_decode(q, *layers[0], tables, lens, PAGE, DIM**-0.5)
        variants = {"engine 64/4/3": functools.partial(engine, q, tables, lens)}
        variants.update((layouts if args.set == "layouts" else serials)(q, tables, lens))
        for name, fn in variants.items():
            try:
                got = fn(*layers[0])
                err = (got.float() - ref.float()).abs().max().item()
                same = (got == ref).float().mean().item()
                us = graph_us([functools.partial(fn, k, v) for k, v in layers])
            except Exception as e:  # a variant that does not compile or launch is reported and skipped
                print(name, "failed", type(e).__name__, str(e)[:200])
                continue
            rows.append({"batch": batch, "context": ctx, "variant": name, "us": us, "gb_per_s": nbytes / us / 1e3,
                         "max_err": err, "same_bits": same})
        del layers
        torch.cuda.empty_cache()
    print(f"{'batch':>5s} {'ctx':>5s} {'variant':22s} {'us':>7s} {'GB/s':>6s} {'err':>9s} {'same':>6s}")
    for r in rows:
        print(f"{r['batch']:5d} {r['context']:5d} {r['variant']:22s} {r['us']:7.2f} {r['gb_per_s']:6.0f} "
              f"{r['max_err']:9.2e} {r['same_bits']:6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
