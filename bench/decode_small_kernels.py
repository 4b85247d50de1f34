"""Two of the decode step's small kernels alone on the GPU, microseconds per call at each row count:

- the fused sampler over a Qwen3 vocabulary (151936 fp32 logits a row), with the Gumbel noise's logs exact
  (libdevice) or one instruction (``FusedSampler(fast_log=...)``);
- q/k norm + RoPE + K/V write (``fused_layer.qkv_rope_write``, the Qwen3-0.6B heads: 16 query, 8 key/value, 128
  wide) at several heads per program.

    python bench/decode_small_kernels.py --rows 64 256 --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch

from unison.engine.fused_layer import qkv_rope_write
from unison.engine.triton_sampler import FusedSampler


def time_us(fn, iters: int = 50) -> float:
    """GPU microseconds per call: ``iters`` calls captured in one CUDA graph, replayed (launched one by one, the host
    would set the pace of kernels this small)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (5 * iters)


class _Norm(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(dim, device="cuda", dtype=torch.bfloat16) + 0.5)
        self.variance_epsilon = 1e-6


def rope_write(rows: int, out: dict, heads: int = 16, kv_heads: int = 8, dim: int = 128) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, device="cuda", generator=g, dtype=torch.bfloat16)
    q = qkv[:, :heads * dim].view(rows, heads, dim)  # views of one projection output, as the engine's
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)
    angles = torch.rand(rows, dim, device="cuda", generator=g)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    slots_total = 16384
    k_pool = torch.zeros(slots_total, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    slots = torch.randperm(slots_total, device="cuda")[:rows]
    q_norm, k_norm = _Norm(dim), _Norm(dim)
    for per in (8, 16, 32):
        us = time_us(lambda p=per: qkv_rope_write(q, k, v, cos, sin, k_pool, v_pool, slots, q_norm, k_norm,
                                                  heads_per_program=p))
        out["us_per_call"][f"qkv_rope_write {rows} rows, {per} heads a program"] = us
        print(f"qkv_rope_write {rows:4d} rows, {per:2d} heads a program: {us:6.1f} us", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = {"vocab": args.vocab, "us_per_call": {}}
    for rows in args.rows:
        logits = 4 * torch.randn(rows, args.vocab, device="cuda")
        temps, seeds = [1.0] * rows, list(range(rows))
        for fast in (False, True):
            sampler = FusedSampler(logits.device, fast_log=fast)
            us = time_us(lambda s=sampler, x=logits, t=temps, r=seeds: s(x, t, r))
            out["us_per_call"][f"{rows} rows, {'fast' if fast else 'exact'} log"] = us
            print(f"sampler {rows:4d} rows, {'fast' if fast else 'exact'} log: {us:7.1f} us "
                  f"({rows * args.vocab * 4 / us / 1e6:.2f} TB/s of fp32 logits)", flush=True)
        rope_write(rows, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
