"""The paged decode kernel alone: time per call and achieved bandwidth over a sweep of tile configurations.

    python bench/decode_kernel.py --json bench/results/h200/decode_kernel.json

Bytes counted: every live K and V element read once, plus q and the output. One call is one layer of a decode
step (Qwen3-0.6B heads: 16 query, 8 KV, dim 128, bf16, 16-token blocks, block tables shuffled across the pool).
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import triton

from unison.engine.backend import StepLayout, TorchPagedBackend
from unison.engine.triton_attention import num_splits, paged_decode

CASES = [(256, 256), (256, 1024), (64, 4096), (8, 4096)]  # (sequences, context)
CONFIGS = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 3)]  # (block_n, warps, stages)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    heads, kv_heads, dim, bs = 16, 8, 128, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, ctx in CASES:
        blocks = batch * ctx // bs + 1
        k = torch.randn(blocks * bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(blocks - 1, device="cuda")[:batch * ctx // bs].view(batch, -1).int()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        nbytes = 2 * batch * ctx * kv_heads * dim * 2 + 2 * q.numel() * 2
        auto = num_splits(batch, kv_heads, ctx, sms)
        for block_n, warps, stages in CONFIGS:
            for splits in sorted({1, auto}):
                call = functools.partial(paged_decode, q, k, v, tables, lens, bs, dim**-0.5, splits=splits,
                                         block_n=block_n, num_warps=warps, num_stages=stages)
                ms = triton.testing.do_bench(call, return_mode="median")
                rows.append({"batch": batch, "context": ctx, "block_n": block_n, "num_warps": warps,
                             "num_stages": stages, "splits": splits, "us": 1e3 * ms, "gb_per_s": nbytes / ms / 1e6})
        if batch * ctx <= 256 * 1024:
            ref = TorchPagedBackend(bs, "cuda")
            layout = StepLayout(list(range(batch + 1)), [ctx] * batch, tables.tolist(),
                                torch.zeros(batch, dtype=torch.int64, device="cuda"))
            state = ref.prepare(layout)
            call = functools.partial(ref.attend, state, k, v, q, dim**-0.5, None)
            ms = triton.testing.do_bench(call, return_mode="median")
            rows.append({"batch": batch, "context": ctx, "reference_path": True, "us": 1e3 * ms,
                         "gb_per_s": nbytes / ms / 1e6})
        del k, v
    print(f"{'B':>4s} {'ctx':>5s} {'bn':>4s} {'w':>2s} {'st':>2s} {'sp':>3s} {'us':>9s} {'GB/s':>7s}")
    for r in rows:
        print(f"{r['batch']:4d} {r['context']:5d} {r.get('block_n', 0):4d} {r.get('num_warps', 0):2d} "
              f"{r.get('num_stages', 0):2d} {r.get('splits', 0):3d} {r['us']:9.1f} {r['gb_per_s']:7.0f}"
              + ("  reference" if r.get("reference_path") else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
