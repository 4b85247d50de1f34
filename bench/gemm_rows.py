"""Does a packed row's token count change the speed of the training step's GEMMs? A decoder layer's matmuls
(forward, d input, d weight) at M tokens, for M a multiple of 16 and M just off it, bf16 on the GPU.

    python bench/gemm_rows.py --shape qwen3-0.6b --tokens 10368 10367 10361 10352 --json gemm_rows.json

Prints milliseconds per layer for each M (the median of 20 CUDA-event timed repeats of the layer's 7 projections x 3
GEMMs). Written to test whether the training steps that ran ~50-100 ms slower were the ones whose rows' lengths came
out off a multiple of 16 (an early <eos> in a rollout). They were not: at 0.6B, 10367 tokens took 1.330 ms a layer
against 1.344 at 10368 (``bench/results/h200/speed/loss_in_forward/3_freeze/gemm_rows_0.6b.json``), and slow steps
came with rows of 36864 tokens as often as with odd ones. Rows are not padded.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from engine import SHAPES


def layer_ms(m: int, shape: dict, repeats: int = 20) -> float:
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    projections = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]  # (in, out)
    weights = [torch.randn(o, i, device="cuda", dtype=torch.bfloat16) * 0.02 for i, o in projections]
    xs = [torch.randn(m, i, device="cuda", dtype=torch.bfloat16) for i, _ in projections]
    grads = [torch.randn(m, o, device="cuda", dtype=torch.bfloat16) for _, o in projections]

    def run():
        for w, x, g in zip(weights, xs, grads, strict=True):
            x @ w.T   # forward
            g @ w     # d input
            g.T @ x   # d weight: the reduction runs over the M tokens
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[10368, 10367, 10361, 10352, 16128, 16127])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [{"tokens": m, "ms_per_layer": round(layer_ms(m, SHAPES[args.shape]), 4)} for m in args.tokens]
    for r in rows:
        print(f"M = {r['tokens']:6d} ({'multiple of 16' if r['tokens'] % 16 == 0 else 'not a multiple of 16'}): "
              f"{r['ms_per_layer']:.3f} ms a layer")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
