"""Why a decode projection reads its weight at half the memory's rate, and which kernel structure reads it faster
(issue 23): one projection y = x @ w.T at decode's rows, in graphs of 28 launches on 28 distinct weights.

    (cd bench && python proj_probe.py --json out.json)

- ``l2/<programs>``: <programs> programs each read the same 128 KB (the rows of x at 64 rows, 1024 wide) from L2:
  the rate at which the programs of a projection can re-read x;
- ``ptr/...``: ``triton_linear``'s kernel with pointer loads (cp.async pipelining; ``fused_linear``'s before the
  descriptor loads) at (BLOCK_N, BLOCK_K, warps, stages);
- ``tma/...``: the same loop on tensor descriptors (the copy engine, mbarrier-pipelined);
- ``swap/...``: tensor descriptors with the weight tile as the product's left operand (its rows on the 64-wide
  side of the matrix instruction, the x rows on the narrow side): column tiles of 64 or 128 with few rows.

Each result is checked against fp32 products first (a wrong variant is reported, not timed). Prints us per launch,
the weight's read rate (bytes / time) and each shape's fastest variant.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import triton
import triton.language as tl
from decode_linear import LAYERS, graph_us
from triton.tools.tensor_descriptor import TensorDescriptor

from unison.engine import triton_linear

SHAPES = {"qkv": (4096, 1024), "gate_up": (6144, 1024), "o": (1024, 2048), "down": (1024, 3072)}  # 0.6B: (N, K)


@triton.jit
def _l2_read(X, Y, share, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, share, BLOCK):
        acc += tl.load(X + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(Y + tl.program_id(0), tl.sum(acc))


@triton.jit(do_not_specialize=["M"])
def _tma_kernel(x_desc, w_desc, Y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SWAP: tl.constexpr, NUM_STAGES: tl.constexpr):
    p = tl.program_id(0)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        x = x_desc.load([0, k])
        w = w_desc.load([p * BLOCK_N, k])
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    rows = tl.arange(0, BLOCK_M)
    cols = p * BLOCK_N + tl.arange(0, BLOCK_N)
    if SWAP:
        tl.store(Y + rows[None, :] * N + cols[:, None], acc.to(Y.dtype.element_ty),
                 mask=(rows < M)[None, :] & (cols < N)[:, None])
    else:
        tl.store(Y + rows[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty),
                 mask=(rows < M)[:, None] & (cols < N)[None, :])


def tma_linear(x, w, block_n, block_k, warps, stages, swap):
    m, k = x.shape
    block_m = max(16, triton.next_power_of_2(m))
    out = x.new_empty(m, w.shape[0])
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k])
    _tma_kernel[(triton.cdiv(w.shape[0], block_n),)](x_desc, w_desc, out, m, w.shape[0], k, BLOCK_M=block_m,
                                                     BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap,
                                                     NUM_STAGES=stages, num_warps=warps)
    return out


def variants(m: int):
    block_m = max(16, triton.next_power_of_2(m))
    for bn, bk, wp, st in itertools.product((16, 32, 64), (64, 128), (4, 8), (3, 5, 8)):
        if (bn == 16 and wp == 8) or (bk == 64 and st == 3):
            continue
        yield f"ptr/{bn}/{bk}/{wp}/{st}", lambda x, w, c=(block_m, bn, bk, wp, st): triton_linear.linear(
            x, w, config=c, loads="pointer")
    for bn, bk, wp, st in itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 5, 8)):
        if (bn == 32 and wp == 8) or (bk == 64 and st == 3):
            continue
        yield f"tma/{bn}/{bk}/{wp}/{st}", lambda x, w, c=(bn, bk, wp, st): tma_linear(x, w, *c, swap=False)
    for bn, bk, wp, st in itertools.product((64, 128), (64, 128), (4,), (3, 5, 8)):
        yield f"swap/{bn}/{bk}/{wp}/{st}", lambda x, w, c=(bn, bk, wp, st): tma_linear(x, w, *c, swap=True)


def median_us(fn) -> float:
    return statistics.median(graph_us(fn, 30) for _ in range(3))


def measure(x: torch.Tensor, ws: list[torch.Tensor], key: str) -> dict:
    """cuBLAS and every variant on rows ``x`` and weights ``ws``: us per launch, or why a variant was not timed."""
    m = x.shape[0]
    n, k = ws[0].shape
    ref = x.float() @ ws[0].float().T
    row = {"cublas": median_us(lambda i: torch.nn.functional.linear(x, ws[i]))}
    for name, fn in variants(m):
        try:
            out = fn(x, ws[0])
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                row[name] = f"wrong ({err:.3g})"
                continue
            row[name] = median_us(lambda i, fn=fn: fn(x, ws[i]))
        except Exception as e:  # a configuration that does not fit
            row[name] = type(e).__name__
    timed = {k2: v for k2, v in row.items() if isinstance(v, float)}
    best = sorted(timed, key=timed.get)[:5]
    floor = 2 * n * k / 1e6
    default = "ptr/" + "/".join(map(str, triton_linear.tiles(m, "pointer")[1:]))
    print(f"{key}: cublas {row['cublas']:.2f} us, {default} {row.get(default)}; best "
          + ", ".join(f"{b} {timed[b]:.2f} us ({floor / timed[b]:.2f} TB/s)" for b in best), flush=True)
    failed = {k2: v for k2, v in row.items() if not isinstance(v, float)}
    if failed:
        print(f"  not timed: {failed}", flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[64])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    y = torch.zeros(1 << 16, device="cuda")
    x_l2 = torch.randn(64 * 1024, device="cuda").bfloat16()
    results = {"l2": {}}
    for programs in (132, 264, 528, 1056):
        us = median_us(lambda i, g=programs: _l2_read[(g,)](x_l2, y, x_l2.numel(), BLOCK=4096))
        results["l2"][programs] = {"us": us, "tb_s": programs * x_l2.numel() * 2 / us / 1e6}
        print(f"l2/{programs}: {us:.2f} us, {results['l2'][programs]['tb_s']:.2f} TB/s", flush=True)
    for shape in args.shapes:
        n, k = SHAPES[shape]
        ws = [torch.randn(n, k, device="cuda").bfloat16() / k**0.5 for _ in range(LAYERS)]
        for m in args.rows:
            results[f"{shape}/{m}"] = measure(torch.randn(m, k, device="cuda").bfloat16(), ws, f"{shape}/{m}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "triton": triton.__version__, **results}, f, indent=1)


if __name__ == "__main__":
    main()
