"""The GPU kernels of one colocated training step of the Qwen3-0.6B shape, summed per kernel name: the step's
unprofiled time (three runs), the GPU's busy time and span in one profiled step, and the top 60 kernels.

    ROWS=16384 python bench/train_kernels.py       # from the repo root; JSON under $OUT (or /tmp)

``train_profile.py``'s samples and step (one real rollout, random rewards, the same weights restored after each
step). Diagnostics, not a benchmark: ``train_profile.py`` measures the step.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(__file__))
from train_profile import setup  # noqa: E402

from unison.train.loss import LossConfig  # noqa: E402
from unison.train.step import train_step  # noqa: E402


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    """The union of (start, end) microsecond intervals, in ms."""
    total, start, end = 0.0, None, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += (end - start) if end is not None else 0.0
            start, end = s, e
        else:
            end = max(end, e)
    return (total + ((end - start) if end is not None else 0.0)) / 1e3


def main():
    rows = int(os.environ.get("ROWS", "16384"))
    model, start, samples, opt = setup("qwen3-0.6b", "cuda", 512)

    def step():
        train_step(model, opt, samples, LossConfig(), 1.0, rows, 0, 1024, kernels=True)
        torch.cuda.synchronize()

    times = []
    for i in range(6):  # three warm-ups (Triton compiles in the first), three timed
        t0 = time.perf_counter()
        step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
        model.load_state_dict(start)
    print("step s", [round(t, 4) for t in times])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
    per_name = defaultdict(lambda: [0.0, 0])
    intervals = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_name[re.sub(r"\s+", " ", e.name)[:110]]
            entry[0] += e.time_range.end - e.time_range.start
            entry[1] += 1
            intervals.append((e.time_range.start, e.time_range.end))
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    top = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:60]
    out = {"step_s": times, "gpu_busy_ms": busy_ms(intervals), "gpu_span_ms": span / 1e3,
           "kernels": [[name, round(us / 1e3, 3), count] for name, (us, count) in top]}
    print(f"gpu busy {out['gpu_busy_ms']:.1f} ms over a span of {out['gpu_span_ms']:.1f} ms")
    for name, ms, count in out["kernels"][:45]:
        print(f"{ms:9.2f} ms {count:6d}  {name}")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), f"prof_train_{rows}.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
