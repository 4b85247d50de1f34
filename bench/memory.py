"""Peak GPU memory and seconds per colocated GRPO step: KV lending on/off, optimizer state on the GPU or in host
memory, for Qwen3 shapes; and the largest shape that trains colocated on one GPU with host placement.

    python bench/memory.py --json bench/results/h200/memory.json

A step is what `unison train` does, without a tokenizer: 8 random 64-token prompts x G=8 samples of 512 tokens
(no stop tokens), random rewards (group advantages), then one packed training step (fp32-master AdamW,
lr 1e-6) inside ``engine.lend()`` or not, then ``engine.weights_updated(version)``. Random bf16 weights.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from contextlib import nullcontext

import torch
from engine import build

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.rollout.advantage import group_advantages
from unison.rollout.sample import Sample
from unison.train.loss import LossConfig
from unison.train.memory import kv_blocks_for
from unison.train.optimizer import OptimConfig, build_optimizer
from unison.train.step import train_step

PROMPTS, GROUP, PROMPT_TOKENS, NEW_TOKENS = 8, 8, 64, 512


def scored_samples(done: list, rewards: list[float]) -> list[Sample]:
    """Completions of consecutive groups of GROUP (``engine.generate`` order) with their rewards and advantages."""
    samples = []
    for k in range(0, len(done), GROUP):
        r = rewards[k:k + GROUP]
        samples += [Sample(tuple(c.prompt_ids), tuple(c.token_ids), tuple(c.logprobs), tuple(c.weight_versions),
                           reward, adv) for c, reward, adv in zip(done[k:k + GROUP], r, group_advantages(r),
                                                                  strict=True)]
    return samples


def grpo_steps(shape: str, placement: str, lend: bool, steps: int, checkpointing: bool, row_tokens: int,
               lora_r: int = 0) -> dict:
    """``lora_r`` > 0: LoRA adapters of that rank (alpha 2r) on every linear layer, trained alone (bench/lora.py)."""
    model = build(shape, "cuda", torch.bfloat16, "unison")
    if lora_r:
        from unison.lora import LoraConfig, apply_lora

        apply_lora(model, LoraConfig(r=lora_r, alpha=2 * lora_r))
    opt = build_optimizer(model.named_parameters(), OptimConfig(lr=1e-6, placement=placement), total_steps=steps)
    blocks = kv_blocks_for(PROMPTS * GROUP, PROMPT_TOKENS, NEW_TOKENS, 16)
    engine = Engine(model, EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=PROMPTS * GROUP,
                                        max_batch_tokens=8192, seed=0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, model.config.vocab_size, (PROMPT_TOKENS,), generator=g).tolist()
               for _ in range(PROMPTS)]
    rng = random.Random(0)
    times, peaks, device_peaks = [], [], []
    for step in range(steps):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        done = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, n=GROUP, seed=step,
                                                       stop_token_ids=()))
        samples = scored_samples(done, [rng.random() for _ in done])
        t1 = time.perf_counter()
        # Device memory = PyTorch's reserved memory + the KV pool (CUDA virtual memory, outside PyTorch's
        # allocator) while it is mapped: the pool is unmapped during a lent step.
        gen_reserved = torch.cuda.max_memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        with engine.lend() if lend else nullcontext(0):
            metrics = train_step(model, opt, samples, LossConfig(), 1.0, row_tokens, 0, 1024, checkpointing)
        engine.weights_updated(step + 1)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        times.append((t2 - t0, t1 - t0, t2 - t1))
        peaks.append(torch.cuda.max_memory_allocated() / 2**30)
        pool = engine.pool.nbytes
        train_reserved = torch.cuda.max_memory_reserved()
        device_peaks.append(max(gen_reserved + pool, train_reserved + (0 if lend else pool)) / 2**30)
        print(f"  {shape} {placement} lend={lend} step {step}: {t2 - t0:.2f} s (gen {t1 - t0:.2f}, train "
              f"{t2 - t1:.2f}), peak {peaks[-1]:.1f} GiB (device {device_peaks[-1]:.1f}), "
              f"changed {metrics['optim/changed_frac']:.2e}", flush=True)
    result = {"shape": shape, "placement": placement, "lend_kv": lend, "activation_checkpointing": checkpointing,
              "lora_r": lora_r, "trainable_b": sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e9,
              "max_tokens_per_row": row_tokens, "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
              "kv_pool_gib": engine.pool.nbytes / 2**30,
              "s_per_step": min(t for t, _, _ in times[1:]) if steps > 1 else times[0][0],
              "generate_s": min(g for _, g, _ in times[1:] or times),
              "train_s": min(t for _, _, t in times[1:] or times),
              "peak_allocated_gib": max(peaks[1:] or peaks),
              "peak_device_gib": max(device_peaks[1:] or device_peaks), "steps": steps}
    del engine, opt, model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", default="qwen3-1.7b,qwen3-4b", help="comma-separated; empty: only --largest")
    p.add_argument("--largest", default="qwen3-8b")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs: list[dict] = []
    out = {"device": torch.cuda.get_device_name(), "workload": f"{PROMPTS * GROUP} samples x "
           f"({PROMPT_TOKENS} + {NEW_TOKENS}) tokens, G={GROUP}", "runs": runs}

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)

    for shape in filter(None, args.shapes.split(",")):
        for placement in ("gpu", "host"):
            for lend in (False, True):
                try:
                    runs.append(grpo_steps(shape, placement, lend, args.steps, False, 8192))
                except torch.OutOfMemoryError as e:
                    runs.append({"shape": shape, "placement": placement, "lend_kv": lend, "error": str(e)[:300]})
                    gc.collect()
                    torch.cuda.empty_cache()
                save()
    at4 = {(r["placement"], r["lend_kv"]): r for r in runs if r.get("shape") == "qwen3-4b" and "s_per_step" in r}
    if ("gpu", True) in at4 and ("host", True) in at4:
        out["host_overhead_frac"] = at4[("host", True)]["s_per_step"] / at4[("gpu", True)]["s_per_step"] - 1
    save()
    if args.largest:
        try:
            largest = grpo_steps(args.largest, "host", True, args.steps, True, 4096)
            runs.append(largest)
            out["largest_model_params_b"] = largest["params_b"]
            out["largest_model_s_per_step"] = largest["s_per_step"]
        except (torch.OutOfMemoryError, RuntimeError) as e:
            out["largest_model_error"] = f"{args.largest}: {str(e)[:300]}"
        save()
    print(f"{'shape':11s} {'placement':9s} {'lend':5s} {'s/step':>7s} {'gen s':>6s} {'train s':>7s} {'peak GiB':>8s}")
    for r in runs:
        if "s_per_step" in r:
            print(f"{r['shape']:11s} {r['placement']:9s} {r['lend_kv']!s:5s} {r['s_per_step']:7.2f} "
                  f"{r['generate_s']:6.2f} {r['train_s']:7.2f} {r['peak_device_gib']:8.1f}")
        else:
            print(f"{r['shape']:11s} {r['placement']:9s} {r['lend_kv']!s:5s} error: {r['error'][:60]}")
    print({k: v for k, v in out.items() if k not in ("runs",)})


if __name__ == "__main__":
    main()
