"""LoRA on one GPU: decode tok/s through unmerged adapters against the base alone, and GRPO steps that train the
adapters alone beside full fine-tuning, up to the largest shape that fits.

    python bench/lora.py --json bench/results/h200/lora/lora.json

Decode: ``--concurrency`` requests of 128-token random prompts, 256 new tokens each (no stop), through the engine's
defaults (CUDA graphs), once to warm up and once timed; the base model first, then the same weights with LoRA r=16
(alpha 32) on every linear layer, ``lora_B`` random so the adapters are not zero, unmerged (PEFT's layers) and
merged (``engine.lora_weights=merged``). Steps: ``bench/memory.py``'s step
(64 samples x (64 + 512) tokens, lr 1e-6) with ``lora_r``: the adapters' fp32 state on the GPU, the KV pool lent.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from engine import build, prompts_for
from memory import grpo_steps

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.lora import LoraConfig, apply_lora

PROMPT, NEW, R = 128, 256, 16


def decode_tok_s(model, concurrency: int, lora_weights: str = "unmerged") -> float:
    blocks = concurrency * ((PROMPT + NEW) // 16 + 2)
    engine = Engine(model, EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=concurrency,
                                        max_batch_tokens=8192, seed=0, lora_weights=lora_weights))
    prompts = prompts_for(model.config.vocab_size, concurrency, PROMPT)
    params = SamplingParams(max_new_tokens=NEW, stop_token_ids=())
    engine.generate(prompts, params)  # warm-up: compiles, captures the decode graphs
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    done = engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return sum(len(c.token_ids) for c in done) / seconds


def decode_runs(shape: str, concurrencies: list[int]) -> list[dict]:
    model = build(shape, "cuda", torch.bfloat16, "unison")
    base = {c: decode_tok_s(model, c) for c in concurrencies}
    torch.manual_seed(0)
    apply_lora(model, LoraConfig(r=R, alpha=2 * R))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    out = []
    for c in concurrencies:
        lora, merged = decode_tok_s(model, c), decode_tok_s(model, c, "merged")
        out.append({"shape": shape, "concurrency": c, "base_tok_s": base[c], "lora_tok_s": lora,
                    "lora_cost_frac": base[c] / lora - 1, "merged_tok_s": merged,
                    "merged_cost_frac": base[c] / merged - 1})
        print(f"  decode {shape} x{c}: base {base[c]:.0f} tok/s, LoRA r={R} unmerged {lora:.0f} tok/s "
              f"({100 * (base[c] / lora - 1):+.1f}% time), merged {merged:.0f}", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--decode", default="qwen3-0.6b:64,qwen3-8b:64,qwen3-8b:256", help="shape:concurrency,...")
    p.add_argument("--steps-shapes", default="qwen3-8b", help="LoRA GRPO steps (checkpointing, rows of 4096)")
    p.add_argument("--largest", default="qwen3-32b")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out: dict = {"device": torch.cuda.get_device_name(), "lora": f"r={R}, alpha={2 * R}, all linear layers",
                 "decode": [], "steps": []}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)

    by_shape: dict[str, list[int]] = {}
    for item in filter(None, args.decode.split(",")):
        shape, c = item.split(":")
        by_shape.setdefault(shape, []).append(int(c))
    for shape, cs in by_shape.items():
        out["decode"] += decode_runs(shape, cs)
        save()
    for shape in [s for s in args.steps_shapes.split(",") if s] + ([args.largest] if args.largest else []):
        for checkpointing, rows in ((True, 4096), (False, 8192)) if shape != args.largest else ((True, 4096),):
            try:
                out["steps"].append(grpo_steps(shape, "gpu", True, args.steps, checkpointing, rows, lora_r=R))
            except (torch.OutOfMemoryError, RuntimeError) as e:
                out["steps"].append({"shape": shape, "lora_r": R, "activation_checkpointing": checkpointing,
                                     "error": str(e)[:300]})
                gc.collect()
                torch.cuda.empty_cache()
            save()
    print(f"{'decode':18s} {'base tok/s':>10s} {'unmerged':>9s} {'cost':>6s} {'merged':>7s} {'cost':>6s}")
    for r in out["decode"]:
        print(f"{r['shape'] + ' x' + str(r['concurrency']):18s} {r['base_tok_s']:10.0f} {r['lora_tok_s']:9.0f} "
              f"{100 * r['lora_cost_frac']:5.1f}% {r['merged_tok_s']:7.0f} {100 * r['merged_cost_frac']:5.1f}%")
    print(f"{'step':12s} {'ckpt':5s} {'rows':>5s} {'s/step':>7s} {'gen s':>6s} {'train s':>7s} {'peak GiB':>8s}")
    for r in out["steps"]:
        if "s_per_step" in r:
            print(f"{r['shape']:12s} {r['activation_checkpointing']!s:5s} {r['max_tokens_per_row']:5d} "
                  f"{r['s_per_step']:7.2f} {r['generate_s']:6.2f} {r['train_s']:7.2f} {r['peak_device_gib']:8.1f}")
        else:
            print(f"{r['shape']:12s} error: {r['error'][:80]}")


if __name__ == "__main__":
    main()
