"""Where a prefill step's time goes: the engine's eager multi-token step (the prompts of bench/engine.py's workload,
``max_batch_tokens`` of them a step), timed alone and then under torch.profiler.

    python bench/prefill_profile.py --shape qwen3-0.6b --concurrency 256 --prompt 128 --json out.json

Each round submits fresh prompts with one new token each, so every step is a prefill step; the first round warms
up. Prints each prefill step's wall time against the GPU's busy time, the top kernels and the host's top operators
of one profiled step. Diagnostics, not a benchmark.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
from engine import SHAPES, build, prompts_for, sync

from unison.engine import Engine, EngineConfig, SamplingParams


def prefill_round(engine: Engine, prompts: list[list[int]], device: str) -> list[tuple[float, int]]:
    """Every prompt with one new token: returns each step's (wall seconds, tokens computed)."""
    for prompt in prompts:
        engine.submit(prompt, SamplingParams(max_new_tokens=1, temperature=1.0, stop_token_ids=()))
    steps = []
    while engine.num_unfinished:
        before = engine.stats()["tokens_computed"]
        sync(device)
        t0 = time.perf_counter()
        engine.step()
        sync(device)
        steps.append((time.perf_counter() - t0, engine.stats()["tokens_computed"] - before))
    return steps


def python_profile(engine: Engine, prompts: list[list[int]], device: str) -> str:
    """The host's Python functions in one prefill step (cProfile), by own time and by cumulative time."""
    for prompt in prompts:
        engine.submit(prompt, SamplingParams(max_new_tokens=1, temperature=1.0, stop_token_ids=()))
    sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    engine.step()
    sync(device)
    profiler.disable()
    while engine.num_unfinished:
        engine.step()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)
    return text.getvalue()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the harness")
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--timing-only", action="store_true", help="the rounds' timing alone, no profiled step")
    p.add_argument("--trace", default=None, help="write the profiled step's Chrome trace here (with Python stacks)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = build(args.shape, args.device, torch.bfloat16, "unison")
    vocab = model.config.vocab_size
    engine = Engine(model, EngineConfig(num_blocks=args.concurrency * -(-(args.prompt + 2) // 16) + 8, block_size=16,
                                        seed=0, max_batch_tokens=args.max_batch_tokens,
                                        max_num_seqs=args.concurrency))
    rounds = [prefill_round(engine, prompts_for(vocab, args.concurrency, args.prompt, seed=10 + r), args.device)
              for r in range(args.rounds)]
    for r, steps in enumerate(rounds):
        print(f"round {r}: " + ", ".join(f"{1e3 * s:.1f} ms ({n} tok)" for s, n in steps))
    steady = [1e3 * s for steps in rounds[1:] for s, n in steps if n == args.max_batch_tokens] or \
             [1e3 * s for steps in rounds[1:] for s, _ in steps]
    summary = {"shape": args.shape, "concurrency": args.concurrency, "prompt": args.prompt,
               "max_batch_tokens": args.max_batch_tokens,
               "rounds_ms_tokens": [[(round(1e3 * s, 2), n) for s, n in steps] for steps in rounds],
               "full_step_ms_median": sorted(steady)[len(steady) // 2]}
    if args.timing_only:
        print(json.dumps(summary))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
        return
    prompts = prompts_for(vocab, args.concurrency, args.prompt, seed=99)
    for prompt in prompts:
        engine.submit(prompt, SamplingParams(max_new_tokens=1, temperature=1.0, stop_token_ids=()))
    sync(args.device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], with_stack=bool(args.trace)) as prof:
        t0 = time.perf_counter()
        engine.step()
        sync(args.device)
        profiled_s = time.perf_counter() - t0
    while engine.num_unfinished:
        engine.step()
    if args.trace:
        prof.export_chrome_trace(args.trace)
    host_profile = python_profile(engine, prompts_for(vocab, args.concurrency, args.prompt, seed=98), args.device)
    print(host_profile)
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    kernels = events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
    host = events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    print(kernels)
    print(host)
    summary.update(profiled_step_ms=1e3 * profiled_s, profiled_gpu_ms=gpu_us / 1e3)
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**summary, "kernels": kernels, "host": host, "python": host_profile}, f, indent=1)


if __name__ == "__main__":
    main()
