"""Where a bench/engine.py run's wall time goes, step by step: the workload of ``engine.py`` (warm-up at the same
concurrency on other prompts, then every prompt submitted at once), each ``Engine.step()`` timed on the host, and
Python's garbage collections during the run (count and pause), and the steps that compiled a Triton kernel variant
or captured a CUDA graph, to tell prefill steps, decode steps and host stalls apart.

    python bench/step_timeline.py --shape qwen3-0.6b --concurrency 256 --json out.json

Prints the first steps one by one, then the decode steps' median, 90th percentile and the slowest, and the
collections per generation.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
import triton
from engine import build, prompts_for, sync

from unison.engine import Engine, EngineConfig, SamplingParams


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the harness")
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--warmup", default="full", choices=["short", "full"],
                   help="as bench/engine.py's: 4 new tokens a request, or the whole workload, on other prompts")
    p.add_argument("--freeze", action="store_true", help="gc.freeze() after the warm-up")
    p.add_argument("--max-batch-tokens", type=int, default=8192, help="the engine's token budget a step (engine.py's)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = build(args.shape, args.device, torch.bfloat16, "unison")
    prompts = prompts_for(model.config.vocab_size, args.concurrency, args.prompt)
    blocks = args.concurrency * -(-(args.prompt + args.new) // 16) + 8
    engine = Engine(model, EngineConfig(num_blocks=blocks, block_size=16, seed=0,
                                        max_batch_tokens=args.max_batch_tokens, max_num_seqs=args.concurrency))
    # The warm-up on other prompts, as engine.py's: the run's own would leave 7/8 of each in the prefix cache.
    engine.generate(prompts_for(model.config.vocab_size, args.concurrency, args.prompt, seed=1),
                    SamplingParams(max_new_tokens=args.new if args.warmup == "full" else 4, stop_token_ids=()))
    sync(args.device)
    if args.freeze:
        gc.freeze()
    pauses, started = [], {}

    def on_gc(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - started["t"]))

    gc.callbacks.append(on_gc)
    compiled: list[str] = []  # kernel variants Triton builds during the run (none, after a complete warm-up)

    def on_compile(*_, **kwargs):
        compiled.append(getattr(kwargs.get("fn"), "name", "?"))
        return False

    triton.knobs.runtime.jit_cache_hook = on_compile
    t0 = time.perf_counter()
    for prompt in prompts:
        engine.submit(prompt, SamplingParams(max_new_tokens=args.new, temperature=1.0, stop_token_ids=()))
    steps = []
    events = []
    while engine.num_unfinished:
        t = time.perf_counter()
        stats = engine.stats()
        before, was_compiled, was_captured = stats["tokens_computed"], len(compiled), stats["graphs_captured"]
        engine.step()
        steps.append((time.perf_counter() - t, engine.stats()["tokens_computed"] - before))
        captured = engine.stats()["graphs_captured"] - was_captured
        if len(compiled) > was_compiled or captured:
            events.append({"step": len(steps) - 1, "ms": round(1e3 * steps[-1][0], 2),
                           "compiled": compiled[was_compiled:], "graphs_captured": captured})
    sync(args.device)
    elapsed = time.perf_counter() - t0
    gc.callbacks.remove(on_gc)
    decode = sorted(s for s, n in steps if n <= args.concurrency)
    wide = [(round(1e3 * s, 2), n) for s, n in steps if n > args.concurrency]
    by_gen = {g: [d for gg, d in pauses if gg == g] for g in sorted({g for g, _ in pauses})}
    result = {"elapsed_s": elapsed, "tokens_per_s": args.concurrency * args.new / elapsed, "steps": len(steps),
              "first_steps_ms_tokens": [(round(1e3 * s, 2), n) for s, n in steps[:12]],
              "prefill_steps_ms_tokens": wide, "prefill_s": sum(s for s, _ in wide) / 1e3,
              "decode_steps": len(decode), "decode_s": sum(decode),
              "decode_ms_median": 1e3 * decode[len(decode) // 2], "decode_ms_p90": 1e3 * decode[int(0.9 * len(decode))],
              "decode_ms_max": 1e3 * decode[-1],
              "gc": {g: {"count": len(d), "total_ms": 1e3 * sum(d), "max_ms": 1e3 * max(d)} for g, d in by_gen.items()},
              "compiles_and_captures": events}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
