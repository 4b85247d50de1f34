"""Where the GPU waits during a bench/engine.py run: the same workload (a full warm-up on other prompts, then every
prompt submitted at once), once plainly for its tokens/s and once under torch.profiler (device activity only), whose
kernel, copy and set intervals give the device's busy time; the rest of the run's wall time is idle, told apart by
where it falls (before the first decode-only step: prefill; from it on: decode) and by gap length.

    python bench/gpu_idle.py --shape qwen3-0.6b --concurrency 256 --json out.json

A decode step that waits on the host shows up as gaps between decode steps' kernels; a device-bound run has the
decode phase busy but for the graph launches' few microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine import build, prompts_for  # noqa: E402
from train_timeline import GPU_CATEGORIES, merged  # noqa: E402

from unison.engine import Engine, EngineConfig, SamplingParams  # noqa: E402


def run(engine: Engine, prompts, new: int, t0: float | None = None) -> tuple[float, list[tuple[float, int, int]]]:
    """Wall seconds of the workload, and each step's (host start, tokens computed, graph steps), in seconds from
    ``t0`` (default: now)."""
    t0 = time.perf_counter() if t0 is None else t0
    for prompt in prompts:
        engine.submit(prompt, SamplingParams(max_new_tokens=new, temperature=1.0, stop_token_ids=()))
    steps, before = [], engine.stats()
    while engine.num_unfinished:  # one stats() a step: the host time this measures is what the engine spends
        t = time.perf_counter()
        engine.step()
        after = engine.stats()
        steps.append((t - t0, after["tokens_computed"] - before["tokens_computed"],
                      after["graph_steps"] - before["graph_steps"]))
        before = after
    torch.cuda.synchronize()
    return time.perf_counter() - t0, steps


def busy_intervals(trace: str) -> list[tuple[float, float]]:
    """The device's activity intervals (us), merged."""
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    return merged([(e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                   if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES])


def idle_between(busy_spans: list[tuple[float, float]], lo: float, hi: float) -> dict:
    """Busy and idle microseconds within [lo, hi], and the idle gaps by length."""
    busy, gaps = 0.0, []
    last = lo
    for a, b in busy_spans:
        a, b = max(a, lo), min(b, hi)
        if b <= a:
            continue
        if a > last:
            gaps.append(a - last)
        busy += b - a
        last = max(last, b)
    if hi > last:
        gaps.append(hi - last)
    span = hi - lo
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "gaps_over_50us": sum(1 for g in gaps if g > 50),
            "idle_in_gaps_over_50us_ms": sum(g for g in gaps if g > 50) / 1e3,
            "largest_gaps_us": sorted((round(g, 1) for g in gaps), reverse=True)[:8]}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    model = build(args.shape, "cuda", torch.bfloat16, "unison")
    prompts = prompts_for(model.config.vocab_size, args.concurrency, args.prompt)
    engine = Engine(model, EngineConfig(num_blocks=args.concurrency * -(-(args.prompt + args.new) // 16) + 8,
                                        block_size=16, seed=0, max_batch_tokens=8192, max_num_seqs=args.concurrency))
    engine.generate(prompts_for(model.config.vocab_size, args.concurrency, args.prompt, seed=1),
                    SamplingParams(max_new_tokens=args.new, temperature=1.0, stop_token_ids=()))
    torch.cuda.synchronize()
    plain_s, _ = run(engine, prompts, args.new)
    marker = torch.empty(1 << 20, device="cuda")
    profiled_prompts = prompts_for(model.config.vocab_size, args.concurrency, args.prompt, seed=2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        marker.fill_(1.0)  # the trace's first device activity, launched on an idle device: its clock's offset
        torch.cuda.synchronize()
        profiled_s, steps = run(engine, profiled_prompts, args.new, t0)
    trace = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(trace)
    busy = busy_intervals(trace)
    t0 = busy[0][0]  # the host's t0 on the trace's clock (to the marker's launch latency, a few us)
    busy = busy[1:]
    first_decode = next(i for i, s in enumerate(steps) if s[2] and s[1] <= args.concurrency)
    lo, mid, hi = t0 + 1e6 * steps[0][0], t0 + 1e6 * steps[first_decode][0], t0 + 1e6 * profiled_s
    result = {"shape": args.shape, "concurrency": args.concurrency, "prompt": args.prompt, "new": args.new,
              "plain_s": plain_s, "plain_tokens_per_s": args.concurrency * args.new / plain_s,
              "profiled_s": profiled_s, "steps": len(steps), "prefill_steps": first_decode,
              "prefill": idle_between(busy, lo, mid), "decode": idle_between(busy, mid, hi)}
    result["decode"]["idle_us_per_step"] = 1e3 * result["decode"]["idle_ms"] / (len(steps) - first_decode)
    print(json.dumps({k: result[k] for k in ("plain_s", "plain_tokens_per_s", "profiled_s", "steps", "prefill_steps")}))
    for phase in ("prefill", "decode"):
        print(phase, json.dumps(result[phase]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
