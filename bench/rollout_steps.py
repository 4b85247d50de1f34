"""Where each rollout of a GRPO run spends its time: every engine step's wall time, the Triton kernels compiled and
the CUDA graphs captured in it, and the rollout loop's host work between steps (landing and scoring completions,
submitting prompts) and Python's garbage collections, per rollout. bench/grpo_step.py's workload, in this process.

    python bench/rollout_steps.py --shape qwen3-0.6b --steps 5 --json rollout_steps.json
    python bench/rollout_steps.py --device cpu --shape tiny --new 16 --steps 2     # a smoke run

A compile is a kernel variant Triton had not built yet in this process (``triton.knobs.runtime.jit_cache_hook``):
it costs ~0.3-0.5 s on the H200 unless Triton's disk cache holds it from an earlier run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import grpo_step  # noqa: E402

from unison.engine.engine import Engine  # noqa: E402
from unison.rollout.loop import RolloutLoop  # noqa: E402

HOST_PHASES = ("_fill", "_land", "_drop_stale", "_take")


class Probe:
    """Wraps ``Engine.step`` and the rollout loop's host phases for the process's lifetime; ``rollouts`` holds one
    record per ``RolloutLoop.next_batch``."""

    def __init__(self):
        self.rollouts: list[dict] = []
        self.current: dict | None = None
        self.compiled: list[str] = []
        self._gc_start = 0.0
        self._install()

    def _install(self) -> None:
        probe = self
        try:
            import triton

            def hook(*args, **kwargs):
                probe.compiled.append(getattr(kwargs.get("fn"), "name", "?"))
                return False  # compile it as usual
            triton.knobs.runtime.jit_cache_hook = hook
        except (ImportError, AttributeError):  # no Triton, or one without the hook: compiles are not counted
            pass
        gc.callbacks.append(self._on_gc)

        step = Engine.step

        def timed_step(engine):
            compiled, captured = len(probe.compiled), _captured(engine)
            t = time.perf_counter()
            out = step(engine)
            dt = time.perf_counter() - t
            if probe.current is not None:
                probe.current["steps"].append({"ms": round(dt * 1e3, 3), "compiled": probe.compiled[compiled:],
                                               "captured": _captured(engine) - captured,
                                               "running": len(engine.scheduler.running)})
            return out
        Engine.step = timed_step

        for name in HOST_PHASES:
            setattr(RolloutLoop, name, self._timed_phase(name, getattr(RolloutLoop, name)))

        next_batch = RolloutLoop.next_batch

        def timed_next_batch(loop, trainer_version):
            probe.current = {"steps": [], "host_ms": {}, "gc_ms": {}}
            t = time.perf_counter()
            out = next_batch(loop, trainer_version)
            probe.current["total_s"] = time.perf_counter() - t
            probe.rollouts.append(probe.current)
            probe.current = None
            return out
        RolloutLoop.next_batch = timed_next_batch

    def _timed_phase(self, name: str, original):
        def phase(loop, *args, **kwargs):
            t = time.perf_counter()
            try:
                return original(loop, *args, **kwargs)
            finally:
                if self.current is not None:
                    calls, ms = self.current["host_ms"].get(name, (0, 0.0))
                    self.current["host_ms"][name] = (calls + 1, ms + (time.perf_counter() - t) * 1e3)
        return phase

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self.current is not None:
            key = f"gen{info['generation']}"
            calls, ms = self.current["gc_ms"].get(key, (0, 0.0))
            self.current["gc_ms"][key] = (calls + 1, ms + (time.perf_counter() - self._gc_start) * 1e3)


def _captured(engine: Engine) -> int:
    return engine.runner.num_captured if engine.runner is not None else 0


def summary(rollout: dict) -> dict:
    steps = rollout["steps"]
    ms = sorted(s["ms"] for s in steps)
    in_steps = sum(ms) / 1e3
    slow = sorted(range(len(steps)), key=lambda i: -steps[i]["ms"])[:4]
    return {"total_s": round(rollout["total_s"], 4), "engine_steps": len(steps), "in_steps_s": round(in_steps, 4),
            "between_steps_s": round(rollout["total_s"] - in_steps, 4), "median_step_ms": ms[len(ms) // 2],
            "compiled": sorted({k for s in steps for k in s["compiled"]}),
            "captured": sum(s["captured"] for s in steps),
            "slowest": [(i, steps[i]["ms"], steps[i]["running"], len(steps[i]["compiled"])) for i in slow],
            "host_ms": {k: (n, round(v, 1)) for k, (n, v) in rollout["host_ms"].items()},
            "gc_ms": {k: (n, round(v, 1)) for k, (n, v) in sorted(rollout["gc_ms"].items())}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step; G=8 samples each")
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--unison-set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    probe = Probe()
    with tempfile.TemporaryDirectory() as work:
        checkpoint = os.path.join(work, "checkpoint")
        grpo_step.make_checkpoint(args.shape, checkpoint, torch.bfloat16, args.device)
        vocab = json.load(open(os.path.join(checkpoint, "config.json")))["vocab_size"]
        prompts = grpo_step.prompt_texts(vocab, args.prompts)
        run = grpo_step.run_unison(checkpoint, prompts, args.new, args.steps, os.path.join(work, "run"),
                                   ["save_final=false", *args.unison_set])
    rows = [summary(r) for r in probe.rollouts]
    print("rollout  total s  in steps s  between s  median step ms  compiled  slowest steps (index, ms, running, "
          "compiles)")
    for i, r in enumerate(rows, 1):
        print(f"{i:7d}  {r['total_s']:7.3f}  {r['in_steps_s']:10.3f}  {r['between_steps_s']:9.3f}  "
              f"{r['median_step_ms']:14.3f}  {len(r['compiled']):8d}  {r['slowest']}")
        print(f"         host ms {r['host_ms']}  gc ms {r['gc_ms']}  compiled {r['compiled']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "shape": args.shape, "overrides": args.unison_set,
                       "every_step": run["every_step"],
                       "rollouts": rows}, f, indent=1)


if __name__ == "__main__":
    main()
