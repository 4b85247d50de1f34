"""MLA decode from the latent KV cache against the expanded one, on a DeepSeek-V2-Lite shape (issue 18).

    python bench/mla_decode.py --device cpu --shape tiny                    # quick, checks the script
    python bench/mla_decode.py --device cuda --json bench/results/h200/mla_decode/mla_decode.json

Random bf16 weights, no download. For each cache (``engine.mla_cache`` latent / expanded), concurrency and prompt
length: KV bytes per token, the pool's size, decode ms per step and tok/s (decode-only steps through the CUDA
graphs, as ``bench/moe_decode.py`` measures them), and the bytes a decode step must read: the weights the step
touches (every expert, at these concurrencies) and the live KV. Then the logprobs of the two caches on the same
sampled tokens. Numbers, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from engine import commit, machine_ceilings, prompts_for, sync
from moe_decode import run_engine
from transformers import AutoModelForCausalLM, DeepseekV2Config

from unison.engine import Engine, EngineConfig, SamplingParams

SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, intermediate_size=128,
                 moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                 first_k_dense_replace=1, vocab_size=512),
    # DeepSeek-V2-Lite (15.7B parameters, 2.4B active): MLA with kv_lora_rank 512, no q LoRA, 64 routed experts.
    "deepseek-v2-lite": dict(hidden_size=2048, num_hidden_layers=27, num_attention_heads=16, kv_lora_rank=512,
                             q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                             intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
                             n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, vocab_size=102400),
}


def build(shape: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    cfg = DeepseekV2Config(**SHAPES[shape], num_key_value_heads=SHAPES[shape]["num_attention_heads"], n_group=1,
                           topk_group=1, max_position_embeddings=16384, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="unison", dtype=dtype)
    return model.eval()


def kv_per_token(cfg, cache: str) -> int:
    """Elements per token and layer."""
    if cache == "latent":
        return cfg.kv_lora_rank + cfg.qk_rope_head_dim
    return cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)


def agreement(model, prompts, new: int) -> dict:
    """Sample with the latent cache; score the same tokens with the expanded cache by teacher-forced steps."""
    params = SamplingParams(max_new_tokens=new, stop_token_ids=(), seed=1)
    out = {}
    for cache in ("latent", "expanded"):
        engine = Engine(model, EngineConfig(num_blocks=len(prompts) * 64, block_size=16, seed=0,
                                            max_num_seqs=len(prompts), mla_cache=cache))
        out[cache] = engine.generate(prompts, params)
        del engine
    same = sum(a.token_ids == b.token_ids for a, b in zip(out["latent"], out["expanded"], strict=True))
    diffs = [abs(x - y) for a, b in zip(out["latent"], out["expanded"], strict=True) if a.token_ids == b.token_ids
             for x, y in zip(a.logprobs, b.logprobs, strict=True)]
    return {"requests": len(prompts), "identical_token_sequences": same,
            "logprob_diff_mean": sum(diffs) / max(len(diffs), 1), "logprob_diff_max": max(diffs, default=0.0)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="deepseek-v2-lite")
    ap.add_argument("--runs", default="64x512,256x512,64x2048", help="concurrency x prompt length, comma separated")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build(args.shape, args.device, dtype)
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    ceilings = machine_ceilings(args.device)
    results = {"shape": args.shape, "config": SHAPES[args.shape], "params": params, "commit": commit(),
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "ceilings": ceilings,
               "runs": []}
    for run in args.runs.split(","):
        concurrency, prompt = (int(x) for x in run.split("x"))
        prompts = prompts_for(cfg.vocab_size, concurrency, prompt)
        for cache in ("latent", "expanded"):
            t0 = time.perf_counter()
            r, engine = run_engine(model, prompts, args.new, args.device, mla_cache=cache)
            per_token = kv_per_token(cfg, cache) * cfg.num_hidden_layers * dtype.itemsize
            context = prompt + args.new // 2
            r.update(cache=cache, concurrency=concurrency, prompt=prompt, new=args.new,
                     kv_bytes_per_token=per_token, pool_gib=engine.pool.nbytes / 2**30,
                     kv_gb_read_per_decode_step=concurrency * context * per_token / 1e9,
                     weight_gb=2 * params / 1e9, wall_s=time.perf_counter() - t0)
            if ceilings["copy_bytes_per_s"]:
                step_bytes = 2 * params + concurrency * context * per_token
                r["roofline_ms_per_decode_step"] = 1e3 * step_bytes / ceilings["copy_bytes_per_s"]
            results["runs"].append(r)
            print(f"{cache:8s} {concurrency:4d} x {prompt:5d}: {r['kv_bytes_per_token'] / 1024:7.1f} KiB/token  "
                  f"pool {r['pool_gib']:6.2f} GiB  decode {r['ms_per_decode_step']:7.2f} ms/step "
                  f"{r['decode_tokens_per_s']:8.0f} tok/s  (generate {r['tokens_per_s']:7.0f} tok/s)", flush=True)
            del engine
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    results["agreement"] = agreement(model, prompts_for(cfg.vocab_size, 8, 64), 32)
    print("latent vs expanded on the same prompts:", results["agreement"])
    sync(args.device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
