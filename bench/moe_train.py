"""One MoE layer's experts in training: forward + backward of transformers' ``grouped_mm`` path against unison's
differentiable Triton experts (``unison.train.fused_experts``), at packed-row token counts.

    python bench/moe_train.py --device cuda --json moe_train.json                  # Qwen3-30B-A3B's and GptOss's
    python bench/moe_train.py --device cuda --shapes qwen3moe --tokens 8192 --sweep   # weight-grad tile sweep

Each row: one layer of the shape, random bf16 weights, routed by a random router's softmax top-k; timed as CUDA
events over ``--reps`` calls after two warm-up calls (no graphs: the trainer runs eagerly), the gradient of every
weight, the routing weights and the hidden states. TFLOP/s counts 3 x the forward's 2 x pairs x H x 3I products
(the backward's two products per GEMM). ``max_rel_diff``: the largest gradient gap between the two, over the
largest gradient, per tensor (bf16 noise: the fp32 comparison is tests/test_moe_grad_gpu.py's).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

import torch
from transformers import GptOssConfig, Qwen3MoeConfig
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from unison.engine import moe
from unison.engine.triton_moe import BlockSizes, block_sizes
from unison.train import fused_experts

SHAPES = {  # (experts, hidden, intermediate, top-k)
    "qwen3moe": (128, 2048, 768, 8),  # Qwen3-30B-A3B's layer
    "gptoss": (32, 2880, 2880, 4),  # GptOss-20B's
    "tiny": (7, 40, 24, 2),  # a CPU smoke run in Triton's interpreter (TRITON_INTERPRET=1), not a measurement
}


def build(shape: str, device: str) -> torch.nn.Module:
    experts, hidden, inter, _ = SHAPES[shape]
    torch.manual_seed(0)
    with torch.device(device):
        if shape == "gptoss":
            block = GptOssExperts(GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts))
        else:
            block = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter,
                                                   num_experts=experts))
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, hidden ** -0.5)
    return block.to(torch.bfloat16)


def timed(fn, device: str, reps: int) -> float:
    fn(), fn()
    if device != "cuda":
        import time
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e3 * (time.perf_counter() - t0) / reps
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def row(shape: str, tokens: int, device: str, reps: int, sweep: bool) -> dict:
    block = build(shape, device)
    experts, hidden, inter, top_k = SHAPES[shape]
    g = torch.Generator(device).manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.bfloat16).requires_grad_(True)
    w, idx = torch.randn(tokens, experts, generator=g, device=device).softmax(-1).topk(top_k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16).requires_grad_(True)
    upstream = torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.bfloat16)
    layout, gate_up_bias, down_bias = moe.module_layout(block)
    params = [x, w, *block.parameters()]

    def theirs_fwd():
        return grouped_mm_experts_forward(block, x, idx, w)

    def ours_fwd():
        return fused_experts.experts(x, idx, w, block.gate_up_proj, block.down_proj, gate_up_bias=gate_up_bias,
                                     down_bias=down_bias, layout=layout)

    def step(fwd):
        def run():
            return torch.autograd.grad(fwd(), params, upstream)
        return run

    flops = 2 * tokens * top_k * hidden * 3 * inter
    out = {"shape": shape, "tokens": tokens, "experts": experts, "hidden": hidden, "inter": inter, "top_k": top_k,
           "block_sizes": asdict(block_sizes(tokens * top_k, experts)),
           "weight_grad_sizes": asdict(fused_experts.weight_grad_sizes(torch.bfloat16))}
    for name, fwd in (("transformers_grouped_mm", theirs_fwd), ("unison_triton", ours_fwd)):
        with torch.no_grad():
            fwd_ms = timed(fwd, device, reps)
        total_ms = timed(step(fwd), device, reps)
        out[name] = {"forward_ms": fwd_ms, "forward_backward_ms": total_ms, "backward_ms": total_ms - fwd_ms,
                     "forward_tflops": flops / fwd_ms / 1e9, "forward_backward_tflops": 3 * flops / total_ms / 1e9}
    theirs, ours = step(theirs_fwd)(), step(ours_fwd)()
    names = ["x", "w", *(n for n, _ in block.named_parameters())]
    out["max_rel_diff"] = {n: float((a.float() - b.float()).abs().max() / b.float().abs().max())
                           for n, a, b in zip(names, ours, theirs, strict=True)}
    out["speedup"] = out["transformers_grouped_mm"]["forward_backward_ms"] / out["unison_triton"]["forward_backward_ms"]
    if sweep:  # the weight-gradient kernel's tile, the rest as chosen
        own = fused_experts.weight_grad_sizes
        out["weight_grad_sweep"] = []
        for sizes in (BlockSizes(128, 128, 32, 8), BlockSizes(128, 128, 64, 8), BlockSizes(64, 128, 32, 4),
                      BlockSizes(128, 64, 32, 4), BlockSizes(64, 64, 64, 4), BlockSizes(128, 256, 32, 8, 3)):
            fused_experts.weight_grad_sizes = lambda dtype, s=sizes: s
            try:
                ms = timed(step(ours_fwd), device, reps)
                out["weight_grad_sweep"].append({**asdict(sizes), "forward_backward_ms": ms})
            except Exception as e:  # noqa: BLE001 (a tile that does not fit shared memory)
                out["weight_grad_sweep"].append({**asdict(sizes), "error": str(e)[:160]})
            finally:
                fused_experts.weight_grad_sizes = own
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shapes", default="qwen3moe,gptoss")
    p.add_argument("--tokens", default="2048,8192", help="comma-separated token counts (a packed row's)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also sweep the weight-gradient kernel's tile")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows = [row(s, int(t), args.device, args.reps, args.sweep) for s in args.shapes.split(",")
            for t in args.tokens.split(",")]
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'shape':9s} {'tokens':>6s} {'gmm fwd+bwd ms':>14s} {'ours ms':>8s} {'speedup':>7s} {'ours TFLOP/s':>12s}")
    for r in rows:
        print(f"{r['shape']:9s} {r['tokens']:6d} {r['transformers_grouped_mm']['forward_backward_ms']:14.2f} "
              f"{r['unison_triton']['forward_backward_ms']:8.2f} {r['speedup']:7.2f} "
              f"{r['unison_triton']['forward_backward_tflops']:12.1f}")


if __name__ == "__main__":
    main()
