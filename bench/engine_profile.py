"""Where a decode step's time goes: host phases and device kernels, for one engine workload on the GPU.

    python bench/engine_profile.py --shape qwen3-0.6b --concurrency 256 --json out.json

Runs the workload's prefill and early decode normally, then profiles decode steps: each phase (schedule,
forward, sample, finish) synchronised so its time is its own, the runner's host-side input preparation timed
alone, and one graph replay under torch.profiler for the kernel breakdown. Diagnostics, not a benchmark. The
phases are those of synchronous steps: with the overlapped decode (the default) a decode step goes around them and
they read 0; ``--sync`` turns it off (engine.async_scheduling=false).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from engine import SHAPES, build, prompts_for

from unison.engine import Engine, EngineConfig, SamplingParams


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sync", action="store_true", help="synchronous steps, whose phases are timed")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = build(args.shape, "cuda", torch.bfloat16, "unison")
    prompts = prompts_for(model.config.vocab_size, args.concurrency, args.prompt)
    engine = Engine(model, EngineConfig(num_blocks=args.concurrency * 40 + 8, block_size=16, seed=0,
                                        max_batch_tokens=8192, max_num_seqs=args.concurrency,
                                        async_scheduling=not args.sync))
    for prompt in prompts:
        engine.submit(prompt, SamplingParams(max_new_tokens=10 * args.steps, stop_token_ids=()))
    for _ in range(args.steps):  # prefill, graph capture, early decode
        engine.step()
    runner_host = []
    call = engine.runner.__class__.__call__

    def timed_call(self, *a, **kw):
        t0 = time.perf_counter()
        out = call(self, *a, **kw)
        runner_host.append(time.perf_counter() - t0)  # host preparation + graph launch, no device wait
        return out

    engine.runner.__class__.__call__ = timed_call
    phases = engine.profile_phases()
    for _ in range(args.steps):
        engine.step()
    engine.profile_phases(False)
    engine.runner.__class__.__call__ = call
    per_step = {k: 1e3 * v / args.steps for k, v in phases.items()}
    per_step["runner_host"] = 1e3 * sum(runner_host) / len(runner_host)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    per_step["unprofiled_step"] = 1e3 * (time.perf_counter() - t0) / args.steps

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60)
    print(table)
    print("ms per decode step:", json.dumps({k: round(v, 3) for k, v in per_step.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "concurrency": args.concurrency, "ms_per_step": per_step,
                       "kernels": table}, f, indent=2)


if __name__ == "__main__":
    main()
