"""Engine throughput: N concurrent requests of random prompts, sampled to a fixed length.

    python bench/engine.py --device cpu                         # tiny model, prints tokens/s and peak memory
    python bench/engine.py --device cuda --shape qwen3-0.6b --concurrency 256 --prompt 128 --new 256

Random weights of the named shape (no download). Not a test: numbers, not assertions.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from unison.engine import Engine, EngineConfig, SamplingParams

SHAPES = {
    "tiny": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, vocab_size=8192),
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
}


def build(shape: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=40960, tie_word_embeddings=shape != "qwen3-8b")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="unison", dtype=dtype)
    return model.eval()


def run(args) -> dict:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    model = build(args.shape, args.device, dtype)
    tokens_per_req = args.prompt + args.new
    blocks = args.concurrency * -(-tokens_per_req // args.block_size) + 8
    engine = Engine(model, EngineConfig(num_blocks=blocks, block_size=args.block_size, seed=0,
                                        max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.concurrency))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, model.config.vocab_size, (args.prompt,), generator=g).tolist()
               for _ in range(args.concurrency)]
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0, stop_token_ids=())
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4, stop_token_ids=()))  # warm-up
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    steps0 = engine.stats()["steps"]
    t0 = time.perf_counter()
    done = engine.generate(prompts, params)
    if args.device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    generated = sum(len(c.token_ids) for c in done)
    steps = engine.stats()["steps"] - steps0
    peak = (torch.cuda.max_memory_allocated() if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"name": f"{args.shape}/{args.concurrency}x({args.prompt}+{args.new})", "device": args.device,
            "tokens_per_s": generated / elapsed, "ms_per_step": 1e3 * elapsed / steps, "steps": steps,
            "generated_tokens": generated, "peak_gib": peak / 2**30, "elapsed_s": elapsed}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    result = run(args)
    print(f"{result['name']} on {args.device}: {result['tokens_per_s']:.0f} tokens/s, "
          f"{result['ms_per_step']:.1f} ms/step, peak {result['peak_gib']:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
