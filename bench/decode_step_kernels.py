"""One decode step's kernels at a GRPO rollout's shape: 64 requests of the Qwen3-0.6B shape at ~``CTX`` + 45 keys,
the unprofiled step time, one profiled step's span and the sum of its kernels' durations, the kernels per name,
and twenty kernels of one layer with the gap before each (negative: it started before the one in front ended).

    CTX=300 python bench/decode_step_kernels.py                 # from the repo root; JSON under $OUT (or /tmp)
    UNISON_PDL=0 CTX=300 python bench/decode_step_kernels.py    # kernels launched one after another

With programmatic dependent launch (the default on Hopper) a kernel starts before the one in front has finished and
waits inside, so its "duration" includes that wait: the per-kernel sums overstate, and ``UNISON_PDL=0`` gives each
kernel's own time. Diagnostics, not a benchmark (``engine.py`` is that).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine import build, prompts_for  # noqa: E402

from unison.engine import Engine, EngineConfig, SamplingParams  # noqa: E402

ROWS = 64


def main():
    ctx = int(os.environ.get("CTX", "300"))
    pdl = os.environ.get("UNISON_PDL", "1")
    model = build("qwen3-0.6b", "cuda", torch.bfloat16, "unison")
    engine = Engine(model, EngineConfig(num_blocks=ROWS * 40 + 8, block_size=16, seed=0, max_batch_tokens=8192,
                                        max_num_seqs=ROWS))
    for prompt in prompts_for(model.config.vocab_size, ROWS, ctx):
        engine.submit(prompt, SamplingParams(max_new_tokens=200, stop_token_ids=()))
    for _ in range(30):  # prefill, graph capture
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(30):
        engine.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / 30 * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    samplers = [i for i, e in enumerate(events) if e.name.startswith("_sample_part")]
    step = events[samplers[1] + 1:samplers[2] + 1]  # one whole step: after a sampler launch, to the next one
    busy = sum(e.time_range.end - e.time_range.start for e in step)
    span = step[-1].time_range.end - step[0].time_range.start
    per_name: dict[str, list] = {}
    for e in step:
        entry = per_name.setdefault(e.name[:40], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.end - e.time_range.start
    print(f"PDL={pdl} ctx~{ctx + 45}: unprofiled step {step_ms:.3f} ms; one profiled step span {span / 1e3:.3f} ms, "
          f"sum of kernel durations {busy / 1e3:.3f} ms, {len(step)} kernels")
    for name, (count, us) in sorted(per_name.items(), key=lambda kv: -kv[1][1]):
        print(f"  {name:42s} {count:4d} {us:9.1f} us  {us / count:7.2f} avg")
    layer, previous = [], None
    for e in step[40:60]:
        gap = e.time_range.start - previous if previous is not None else 0
        layer.append([e.name[:32], round(e.time_range.end - e.time_range.start, 2), round(gap, 2)])
        previous = e.time_range.end
    for row in layer:
        print("   ", row)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, f"prof_decode_pdl{pdl}_{ctx}.json"), "w") as f:
        json.dump({"pdl": pdl, "ctx": ctx, "step_ms": step_ms, "span_us": span, "busy_us": busy, "agg": per_name,
                   "layer": layer}, f)


if __name__ == "__main__":
    main()
