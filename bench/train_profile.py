"""Where a colocated GRPO training step's time goes: the step at several packed-row sizes, the optimizer alone,
and the top operators of one step under torch.profiler.

    python bench/train_profile.py --json bench/results/h200/train_profile.json      # GPU, qwen3-1.7b
    python bench/train_profile.py --device cpu --shape tiny --new 16                 # the harness

The samples are one real rollout (8 prompts x G=8 of ``--new`` tokens from the engine, random rewards), as in
``grpo_step.py``; each measurement trains on the same samples from the same weights (restored after each step).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from engine import SHAPES, build, commit, machine_ceilings
from memory import GROUP, PROMPT_TOKENS, PROMPTS, scored_samples

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.train.loss import LossConfig
from unison.train.optimizer import OptimConfig, build_optimizer
from unison.train.step import train_step


def timed(device: torch.device, fn) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def setup(shape: str, device: str, new: int):
    """The shape's model, a copy of its starting weights, one rollout's samples (``rollout_samples``) and an
    optimizer at lr 1e-6."""
    model = build(shape, device, torch.bfloat16, "unison")
    start = {n: t.detach().clone() for n, t in model.state_dict().items()}
    samples = rollout_samples(model, new)
    return model, start, samples, build_optimizer(model.named_parameters(), OptimConfig(lr=1e-6), total_steps=100)


def rollout_samples(model: torch.nn.Module, new: int) -> list:
    """One real rollout of ``model``: PROMPTS random prompts x GROUP completions of ``new`` tokens, random rewards."""
    engine = Engine(model, EngineConfig(num_blocks=PROMPTS * GROUP * (-(-(PROMPT_TOKENS + new) // 16) + 1),
                                        block_size=16, max_num_seqs=PROMPTS * GROUP, seed=0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, model.config.vocab_size, (PROMPT_TOKENS,), generator=g).tolist()
               for _ in range(PROMPTS)]
    done = engine.generate(prompts, SamplingParams(max_new_tokens=new, n=GROUP, seed=0, stop_token_ids=()))
    return scored_samples(done, torch.rand(len(done), generator=g).tolist())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES))
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--rows", type=int, nargs="+", default=[4096, 8192, 16384], help="max_tokens_per_row values")
    p.add_argument("--kernels", default="both", choices=["on", "off", "both"],
                   help="the trainer's fused kernels (step.fused_kernels): each row size with them, without, or both")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    model, start, samples, opt = setup(args.shape, args.device, args.new)

    def step(rows: int, kernels: bool = True) -> dict:
        return train_step(model, opt, samples, LossConfig(), 1.0, rows, 0, 1024, kernels=kernels)

    def measured(rows: int, kernels: bool) -> float:
        seconds = timed(device, lambda: step(rows, kernels))
        # The same weights for every measurement, restored outside the timing (until 9428d85 it was inside: ~310
        # copies a measurement).
        model.load_state_dict(start)
        return seconds

    tokens = sum(s.num_tokens for s in samples)
    params = sum(p_.numel() for p_ in model.parameters())
    ceilings = machine_ceilings(args.device)
    out = {"shape": args.shape, "commit": commit(), "samples": len(samples), "tokens": tokens, "params": params,
           "ceilings": ceilings, "mfu": "6 x params x tokens / train_s / bf16_flops_per_s", "rows": {},
           "rows_without_kernels": {}}
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.kernels]
    for kernels in settings:
        measured(args.rows[0], kernels)  # warm-up (Triton compiles its kernels in the first)
    for rows in args.rows:
        for kernels in settings:
            key = "rows" if kernels else "rows_without_kernels"
            try:
                seconds = min(measured(rows, kernels) for _ in range(2))
                entry = {"train_s": seconds, "peak_gib": torch.cuda.max_memory_allocated() / 2**30
                         if device.type == "cuda" else None}
                if ceilings["bf16_flops_per_s"]:
                    entry["mfu"] = 6 * params * tokens / seconds / ceilings["bf16_flops_per_s"]
                out[key][rows] = entry
            except torch.OutOfMemoryError as e:
                out[key][rows] = {"error": str(e)[:200]}
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            print(f"max_tokens_per_row {rows}, kernels {kernels}: {out[key][rows]}", flush=True)
    for p_ in model.parameters():  # the optimizer alone, on gradients of the right shapes
        p_.grad = torch.full_like(p_, 1e-4)
    out["optimizer_s"] = min(timed(device, opt.step) for _ in range(2))
    opt.zero_grad()
    model.load_state_dict(start)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        step(args.rows[0], settings[0])
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=20)
    print(table)
    out["top_ops"] = table
    print(f"optimizer alone {out['optimizer_s']:.3f} s; " + ", ".join(
        f"rows {r}{'' if key == 'rows' else ' (no kernels)'}: {v.get('train_s', float('nan')):.3f} s, "
        f"MFU {v.get('mfu', float('nan')):.3f}" for key in ("rows", "rows_without_kernels")
        for r, v in out[key].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
