"""The paged decode kernel alone: time per call and achieved bandwidth over a sweep of tile configurations.

    python bench/decode_kernel.py --json bench/results/h200/decode_kernel.json
    python bench/decode_kernel.py --suite short --json decode_kernel_short.json   # the GRPO contexts, in graphs

Bytes counted: every live K and V element read once, plus q and the output. One call is one layer of a decode
step (Qwen3-0.6B heads: 16 query, 8 KV, dim 128, bf16, 16-token blocks, block tables shuffled across the pool).
``--suite long`` (the default) times single calls with ``triton.testing.do_bench``; ``--suite short`` times what a
decode step does: ``--layers`` calls on as many pools (no layer's KV in the cache when its turn comes) captured in
one CUDA graph, the median replay over the layers, at the short contexts of a GRPO rollout; its configurations add
the split count.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton

from unison.engine.backend import StepLayout, TorchPagedBackend
from unison.engine.triton_attention import num_splits, paged_decode

HEADS, KV_HEADS, DIM, PAGE = 16, 8, 128, 16
SUITES = {
    # (sequences, context), (block_n, warps, stages), splits ("auto": num_splits's)
    "long": ([(256, 256), (256, 1024), (64, 4096), (8, 4096)],
             [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 3)], ("auto",)),
    "short": ([(64, 192), (64, 320), (64, 576), (256, 192), (256, 320)],
              [(16, 2, 2), (32, 2, 2), (32, 4, 2), (32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 2)], (1, 2, 4)),
}


def pools(batch: int, ctx: int, count: int):
    """``count`` layers' K and V pools with shuffled block tables, the queries and the context lengths."""
    blocks = batch * -(-ctx // PAGE) + 1
    layers = [(torch.randn(blocks * PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16),
               torch.randn(blocks * PAGE, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)) for _ in range(count)]
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(blocks - 1, device="cuda")[:batch * -(-ctx // PAGE)].view(batch, -1).int()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return layers, q, tables, lens


def graph_us(calls, replays: int = 50) -> float:
    """Median replay time of one CUDA graph of ``calls``, per call, in microseconds."""
    for call in calls:  # compile and warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 1e3 * sorted(times)[len(times) // 2] / len(calls)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--suite", choices=sorted(SUITES), default="long")
    p.add_argument("--layers", type=int, default=28, help="--suite short: calls (layers) per captured graph")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cases, configs, split_choices = SUITES[args.suite]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, ctx in cases:
        layers, q, tables, lens = pools(batch, ctx, args.layers if args.suite == "short" else 1)
        nbytes = 2 * batch * ctx * KV_HEADS * DIM * 2 + 2 * q.numel() * 2
        auto = num_splits(batch, KV_HEADS, ctx, sms)
        for block_n, warps, stages in configs:
            for splits in sorted({s if s != "auto" else auto for s in split_choices} | {1}):
                calls = [functools.partial(paged_decode, q, k, v, tables, lens, PAGE, DIM**-0.5, splits=splits,
                                           block_n=block_n, num_warps=warps, num_stages=stages) for k, v in layers]
                if args.suite == "short":
                    us = graph_us(calls)
                else:
                    us = 1e3 * triton.testing.do_bench(calls[0], return_mode="median")
                rows.append({"batch": batch, "context": ctx, "block_n": block_n, "num_warps": warps,
                             "num_stages": stages, "splits": splits, "auto_splits": auto, "us": us,
                             "gb_per_s": nbytes / us / 1e3})
        if args.suite == "long" and batch * ctx <= 256 * 1024:
            k, v = layers[0]
            ref = TorchPagedBackend(PAGE, "cuda")
            layout = StepLayout(list(range(batch + 1)), [ctx] * batch, tables.tolist(),
                                torch.zeros(batch, dtype=torch.int64, device="cuda"))
            state = ref.prepare(layout)
            call = functools.partial(ref.attend, state, k, v, q, DIM**-0.5, None)
            us = 1e3 * triton.testing.do_bench(call, return_mode="median")
            rows.append({"batch": batch, "context": ctx, "reference_path": True, "us": us,
                         "gb_per_s": nbytes / us / 1e3})
        del layers
        torch.cuda.empty_cache()
    print(f"{'B':>4s} {'ctx':>5s} {'bn':>4s} {'w':>2s} {'st':>2s} {'sp':>3s} {'us':>9s} {'GB/s':>7s}")
    for r in rows:
        print(f"{r['batch']:4d} {r['context']:5d} {r.get('block_n', 0):4d} {r.get('num_warps', 0):2d} "
              f"{r.get('num_stages', 0):2d} {r.get('splits', 0):3d} {r['us']:9.1f} {r['gb_per_s']:7.0f}"
              + ("  reference" if r.get("reference_path") else ""))
    best = {}
    for r in rows:
        key = (r["batch"], r["context"])
        if "block_n" in r and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("best per case:")
    for (batch, ctx), r in best.items():
        engine = [x["us"] for x in rows if (x["batch"], x["context"]) == (batch, ctx) and x.get("block_n") == 64
                  and x.get("num_warps") == 4 and x.get("num_stages") == 3 and x.get("splits") == x.get("auto_splits")]
        now = min(engine, default=float("nan"))
        print(f"  {batch}x{ctx}: {r['us']:.1f} us ({r['gb_per_s']:.0f} GB/s) bn={r['block_n']} w={r['num_warps']} "
              f"st={r['num_stages']} sp={r['splits']}; the engine's default {now:.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "suite": args.suite, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
