"""The host's time per call of what the training step's forward and backward run per layer, on inputs so small that
the GPU never holds the host back: what one packed row costs the host whatever its length (issue 23).

    (cd bench && python host_launch.py --json out.json)

Reports microseconds of host time per call: PyTorch ops (an add, a linear), unison's Triton kernels (the engine's
RMSNorm, the trainer's differentiable one, its SwiGLU), then one Qwen3 decoder layer and the whole model, forward
alone and forward + backward, under the trainer's fused kernels (``training_kernels``), at 16 tokens.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from engine import SHAPES, build

from unison.engine import fused_norm
from unison.engine.attention import NO_MASK
from unison.train import fused
from unison.train.logprobs import training_kernels


def host_us(fn, calls: int = 300) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--cprofile", action="store_true", help="also print cProfile's view of the layer's forward+backward")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = build(args.shape, "cuda", torch.bfloat16, "unison")
    h = model.config.hidden_size
    x = torch.randn(1, args.tokens, h, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lin = torch.nn.Linear(h, h, bias=False, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    out = {
        "torch.add": host_us(lambda: x + x),
        "F.linear": host_us(lambda: lin(x)),
        "engine rms_norm (Triton)": host_us(lambda: fused_norm.rms_norm(x, w.detach(), 1e-6)),
        "trainer rms_norm (autograd + Triton)": host_us(lambda: fused.rms_norm(xg, w, 1e-6)),
        "trainer silu_mul (autograd + Triton)": host_us(lambda: fused.silu_mul(xg, xg)),
    }
    layer = model.model.layers[0]
    position_ids = torch.arange(args.tokens, device="cuda")[None]
    cu = torch.tensor([0, args.tokens], dtype=torch.int32, device="cuda")
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": args.tokens, "max_length_k": args.tokens,
              "position_ids": position_ids}
    input_ids = torch.randint(10, 1000, (1, args.tokens), device="cuda")

    def layer_forward():
        return layer(xg, position_embeddings=model.model.rotary_emb(x, position_ids), **kwargs)

    def model_forward():  # the decoder, as policy_logprobs runs it (the chunked lm_head aside)
        return model.model(input_ids=input_ids, attention_mask=NO_MASK, use_cache=False,
                           **kwargs).last_hidden_state

    with training_kernels(model, True):
        out["decoder layer forward"] = host_us(layer_forward, 100)
        out["decoder layer forward + backward"] = host_us(lambda: layer_forward()[0].sum().backward(), 100)
        out["model forward"] = host_us(model_forward, 30)
        out["model forward + backward"] = host_us(lambda: model_forward().float().sum().backward(), 30)
        if args.cprofile:
            import cProfile
            import pstats

            with cProfile.Profile() as prof:
                for _ in range(50):
                    layer_forward()[0].sum().backward()
                torch.cuda.synchronize()
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(35)
            stats.sort_stats("cumulative").print_stats(45)
    width = max(map(len, out))
    for k, v in out.items():
        print(f"{k:<{width}}  {v:9.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "tokens": args.tokens, "host_us_per_call": out}, f, indent=2)


if __name__ == "__main__":
    main()
