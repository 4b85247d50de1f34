"""A packed training row's causal attention, forward and backward: flash varlen (torch's FA2) against cuDNN's fused
attention through unison.engine.cudnn_attention, on one GPU.

    python bench/packed_attention.py --json packed_attention.json

Rows of ~16k tokens at 16 query and 8 KV heads of 128 (Qwen3-0.6B and 1.7B): 28 samples of 576 tokens (the GRPO
benchmark's) and 22 of 80-1161 (random). Per layer call, ms of GPU time (CUDA events, mean of 20 after 3 warm-ups)
and of host time; the first cuDNN call's graph build is reported apart. Agreement: max |difference| to flash.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from unison.engine import cudnn_attention  # noqa: E402
from unison.engine.attention_ops import varlen_attention  # noqa: E402


def timed(fn, iters=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    host = (time.perf_counter() - t0) / iters * 1e3
    torch.cuda.synchronize()
    return round(a.elapsed_time(b) / iters, 4), round(host, 4)


def lengths_of(kind: str, tokens: int) -> list[int]:
    if kind == "equal576":
        return [576] * (tokens // 576)
    g = torch.Generator().manual_seed(1)
    out: list[int] = []
    while True:
        n = int(torch.randint(80, 1200, (1,), generator=g))
        if sum(out) + n > tokens:
            return out
        out.append(n)


def case(lengths, heads, kv_heads, width):
    tokens, longest, scale = sum(lengths), max(lengths), width ** -0.5
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(tokens, h, width, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(tokens, heads, width, device="cuda", dtype=torch.bfloat16)
    systems = {"flash": lambda: varlen_attention(q, k, v, cu, cu, longest, longest, scale),
               "cudnn": lambda: cudnn_attention.causal(q, k, v, cu, longest, scale)}
    out: dict = {"tokens": tokens, "samples": len(lengths), "longest": longest,
                 "flops_forward": sum(2 * n * (n + 1) * heads * width for n in lengths)}
    results = {}
    with cudnn_attention.packed_rows():
        t0 = time.perf_counter()
        o = systems["cudnn"]()
        o.backward(grad)
        torch.cuda.synchronize()
        out["cudnn_first_call_s"] = round(time.perf_counter() - t0, 3)
        for name, fn in systems.items():
            results[name] = [t.detach().clone() for t in (fn(),)]
            q.grad = k.grad = v.grad = None
            fn().backward(grad)
            results[name] += [q.grad.clone(), k.grad.clone(), v.grad.clone()]
            with torch.no_grad():
                out[f"{name}_forward_ms"], out[f"{name}_forward_host_ms"] = timed(fn)
            o = fn()
            out[f"{name}_backward_ms"], out[f"{name}_backward_host_ms"] = timed(
                lambda o=o: torch.autograd.grad(o, (q, k, v), grad, retain_graph=True))
    out["max_diff_out_dq_dk_dv"] = [(a.float() - b.float()).abs().max().item()
                                    for a, b in zip(results["cudnn"], results["flash"], strict=True)]
    out["max_abs_out_dq_dk_dv"] = [b.float().abs().max().item() for b in results["flash"]]
    out["cudnn_forward_tflops"] = round(out["flops_forward"] / out["cudnn_forward_ms"] / 1e9, 1)
    out["flash_forward_tflops"] = round(out["flops_forward"] / out["flash_forward_ms"] / 1e9, 1)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if cudnn_attention.frontend() is None:
        raise SystemExit("cuDNN's frontend is not installed: pip install 'unison[gpu]'")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "cases": {}}
    for kind in ("equal576", "random"):
        result["cases"][kind] = case(lengths_of(kind, args.tokens), args.heads, args.kv_heads, args.width)
        c = result["cases"][kind]
        print(f"{kind:9s} {c['samples']} samples, {c['tokens']} tokens | forward flash {c['flash_forward_ms']:.3f} "
              f"cudnn {c['cudnn_forward_ms']:.3f} ms | backward flash {c['flash_backward_ms']:.3f} cudnn "
              f"{c['cudnn_backward_ms']:.3f} ms | max diff {c['max_diff_out_dq_dk_dv']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
