"""Where the GPU waits during a colocated training step: one ``train_step`` under torch.profiler, its kernels'
busy time against the wall time, per phase (each row's forward, loss, backward, then the optimizer step), and the
idle gaps of the GPU by the phase the host was in when they happened.

    python bench/train_timeline.py --shape qwen3-0.6b --rows 8192 --json out.json
    python bench/train_timeline.py --device cpu --shape tiny --new 16        # a smoke run of the harness

A phase whose GPU busy time is well under its wall time is host-bound: the GPU ran out of queued kernels there.
The samples are ``train_profile.py``'s (one real rollout, random rewards). Diagnostics, not a benchmark: the profiler
adds host time per operation, so the unprofiled step (``step_s``) is reported beside it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from engine import SHAPES, commit
from train_profile import setup

import unison.train.step as step_module
from unison.train.loss import LossConfig

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def labelled(fn, label: str):
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)
    return wrapper


def profiled_trace(run: Callable[[], object], cuda: bool) -> tuple[object, dict]:
    """``run()`` under torch.profiler, ``train_step``'s forwards, losses and optimizer step labelled ``forward``,
    ``loss`` and ``optimizer`` (what ``analyse`` reads): its result and the chrome trace."""
    originals = {k: getattr(step_module, k) for k in ("policy_logprobs", "grpo_loss", "_optimizer_step")}
    for (k, fn), label in zip(originals.items(), ("forward", "loss", "optimizer"), strict=True):
        setattr(step_module, k, labelled(fn, label))
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    try:
        with torch.profiler.profile(activities=activities) as prof:
            out = run()
            if cuda:
                torch.cuda.synchronize()
    finally:
        for k, fn in originals.items():
            setattr(step_module, k, fn)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return out, json.load(f)


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def busy_within(busy: list[tuple[float, float]], a: float, b: float) -> float:
    return sum(max(0.0, min(y, b) - max(x, a)) for x, y in busy)


def analyse(trace: dict) -> dict:
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATEGORIES]
    busy = merged(gpu)
    marks = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                   if e.get("cat") == "user_annotation" and e["name"] in ("forward", "loss", "optimizer"))
    # The phases in host order: forward, loss, backward (from the loss's end to the next mark), optimizer.
    phases: list[tuple[float, float, str]] = []
    for i, (a, b, name) in enumerate(marks):
        phases.append((a, b, name))
        if name == "loss":
            end = marks[i + 1][0] if i + 1 < len(marks) else b
            phases.append((b, end, "backward"))
    start = min(a for a, _, _ in phases)
    end = max([b for _, b in busy] + [b for _, b, _ in phases])
    launches = [e["ts"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and "aunch" in e["name"]]
    syncs = [(e["name"], e["dur"]) for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
             and ("ynchronize" in e["name"] or "Memcpy" in e["name"]) and e["dur"] > 50]
    per_phase: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for a, b, name in phases:
        p = per_phase[name]
        p["count"] += 1
        p["wall_ms"] += (b - a) / 1e3
        p["gpu_busy_ms"] += busy_within(busy, a, b) / 1e3
        p["launches"] += sum(a <= t < b for t in launches)
    gaps: dict[str, float] = defaultdict(float)
    for (_, y), (x, _) in zip(busy, busy[1:], strict=False):
        if y < start or x - y < 5:
            continue
        host = next((name for a, b, name in phases if a <= y < b), "outside")
        gaps[host] += (x - y) / 1e3
    total_busy = busy_within(busy, start, end) / 1e3
    return {"wall_ms": (end - start) / 1e3, "gpu_busy_ms": total_busy, "kernels": len(gpu),
            "phases": {k: dict(v) for k, v in per_phase.items()}, "gpu_idle_ms_by_host_phase": dict(gaps),
            "host_waits_over_50us": {"count": len(syncs), "ms": sum(d for _, d in syncs) / 1e3}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the harness")
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--rows", type=int, default=8192, help="max_tokens_per_row")
    p.add_argument("--trace", default=None, help="also write the chrome trace here (gzipped)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    model, start, samples, opt = setup(args.shape, args.device, args.new)

    def step():
        step_module.train_step(model, opt, samples, LossConfig(), 1.0, args.rows, 0, 1024)

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()  # warm-up: Triton compiles
    synchronize()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        synchronize()
        times.append(time.perf_counter() - t0)
    model.load_state_dict(start)
    _, trace = profiled_trace(step, device.type == "cuda")
    if args.trace:
        with gzip.open(args.trace, "wt") as g:
            json.dump(trace, g)
    out = {"shape": args.shape, "commit": commit(), "rows": args.rows, "step_s": times, **analyse(trace)}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
