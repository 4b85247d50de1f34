"""Where each rollout of a GRPO run spends its time: every engine step's wall time, the Triton kernels compiled and
the CUDA graphs captured in it, and the rollout loop's host work between steps (landing and scoring completions,
submitting prompts) and Python's garbage collections, per rollout. bench/grpo_step.py's workload, in this process.

    python bench/rollout_steps.py --shape qwen3-0.6b --steps 5 --json rollout_steps.json
    python bench/rollout_steps.py --device cpu --shape tiny --new 16 --steps 2     # a smoke run

A compile is a kernel variant Triton had not built yet in this process (``triton.knobs.runtime.jit_cache_hook``):
it costs ~0.3-0.5 s on the H200 unless Triton's disk cache holds it from an earlier run.

``--profile-train N`` runs the Nth training step of the loop under torch.profiler and reports, as
``train_timeline.py`` does for a standalone step, the GPU's busy time against the wall time per phase, plus the host
time before the first forward (packing, copies) and after the optimizer (metrics read back). The profiler adds host
time per operation: the other steps' ``train_s`` are the unprofiled ones.
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
import train_timeline  # noqa: E402
from stack_sampler import StackSampler  # noqa: E402

import unison.train.loop as train_loop  # noqa: E402
from unison.engine.engine import Engine  # noqa: E402
from unison.rollout.loop import RolloutLoop  # noqa: E402

HOST_PHASES = ("_fill", "_land", "_drop_stale", "_take")


class Probe:
    """Wraps ``Engine.step`` and the rollout loop's host phases for the process's lifetime; ``rollouts`` holds one
    record per ``RolloutLoop.next_batch``."""

    def __init__(self):
        self.rollouts: list[dict] = []
        self.trains: list[dict] = []  # per training step: time, allocator counts, collections, Triton compiles
        self.current: dict | None = None
        self.compiled: list[str] = []
        self.full_collections: list[dict] = []  # every generation-2 collection after the probe started
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
            if probe.current is not None and "steps" in probe.current:
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
            before, t = allocator_counts(), time.perf_counter()
            out = next_batch(loop, trainer_version)
            probe.current["total_s"] = time.perf_counter() - t
            probe.current["span"] = (t, time.perf_counter())
            probe.current["allocator"] = counts_since(before)
            probe.rollouts.append(probe.current)
            probe.current = None
            return out
        RolloutLoop.next_batch = timed_next_batch

        train_step = train_loop.train_step

        def counted_train_step(*args, **kwargs):
            probe.current = {"gc_ms": {}}  # collections during the step land here
            before, compiled, t = allocator_counts(), len(probe.compiled), time.perf_counter()
            out = train_step(*args, **kwargs)
            gcs = {k: (n, round(v, 1)) for k, (n, v) in sorted(probe.current["gc_ms"].items())}
            samples = args[2] if len(args) > 2 else kwargs["samples"]
            probe.trains.append({"s": round(time.perf_counter() - t, 4), "tokens": sum(s.num_tokens for s in samples),
                                 **counts_since(before), "gc_ms": gcs,
                                 "compiled": probe.compiled[compiled:], "span": (t, time.perf_counter())})
            probe.current = None
            return out
        train_loop.train_step = counted_train_step

    def _timed_phase(self, name: str, original):
        def phase(loop, *args, **kwargs):
            t = time.perf_counter()
            try:
                return original(loop, *args, **kwargs)
            finally:
                if self.current is not None and "host_ms" in self.current:
                    calls, ms = self.current["host_ms"].get(name, (0, 0.0))
                    self.current["host_ms"][name] = (calls + 1, ms + (time.perf_counter() - t) * 1e3)
        return phase

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif info["generation"] == 2:  # a full collection: how much it walked, and how much was frozen
            self.full_collections.append({"ms": round((time.perf_counter() - self._gc_start) * 1e3, 1),
                                          "collected": info["collected"], "frozen": gc.get_freeze_count(),
                                          "tracked": len(gc.get_objects(generation=2)),
                                          "in": f"rollout {len(self.rollouts) + 1}" if self.current is not None
                                          and "steps" in self.current else f"train {len(self.trains) + 1}"
                                          if self.current is not None else "between"})
        if phase == "stop" and self.current is not None:
            key = f"gen{info['generation']}"
            calls, ms = self.current["gc_ms"].get(key, (0, 0.0))
            self.current["gc_ms"][key] = (calls + 1, ms + (time.perf_counter() - self._gc_start) * 1e3)


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def allocator_counts() -> dict[str, int]:
    """The CUDA caching allocator's cumulative counts: a retry is an allocation that failed, freed every cached
    block (synchronizing the device) and tried again; device allocs and frees are cudaMalloc and cudaFree calls."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def counts_since(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in allocator_counts().items()}


def profile_train(call: int) -> dict:
    """Profile the ``call``-th ``train_step`` of the loop (1-based); the returned dict fills in when it has run."""
    found: dict = {}
    original = train_loop.train_step
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] != call:
            return original(*args, **kwargs)

        def marked_step():
            with torch.profiler.record_function("train_step"):
                return original(*args, **kwargs)
        out, trace = train_timeline.profiled_trace(marked_step, torch.cuda.is_available())
        found.update(train_timeline.analyse(trace))
        outer = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name") == "train_step"
                 and e.get("cat") == "user_annotation"]
        marks = {name: [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("name") == name
                        and e.get("cat") == "user_annotation"] for name in ("forward", "optimizer")}
        if outer and marks["forward"] and marks["optimizer"]:
            a, b = outer[0]["ts"], outer[0]["ts"] + outer[0]["dur"]
            found["train_step_wall_ms"] = (b - a) / 1e3
            found["before_first_forward_ms"] = (min(e["ts"] for e in marks["forward"]) - a) / 1e3
            found["after_optimizer_ms"] = (b - max(e["ts"] + e["dur"] for e in marks["optimizer"])) / 1e3
        return out
    train_loop.train_step = wrapped
    return found


def phase_of(t: float, probe: Probe) -> str:
    """Which rollout or training step (1-based) perf_counter time ``t`` fell in."""
    for kind, records in (("rollout", probe.rollouts), ("train", probe.trains)):
        for i, r in enumerate(records, 1):
            if r["span"][0] <= t <= r["span"][1]:
                return f"{kind} {i}"
    return "between"


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
            "allocator": rollout.get("allocator", {}),
            "gc_ms": {k: (n, round(v, 1)) for k, (n, v) in sorted(rollout["gc_ms"].items())}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step; G=8 samples each")
    p.add_argument("--new", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--unison-set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--profile-train", type=int, default=0, metavar="N",
                   help="profile the Nth training step (see the module's docstring)")
    p.add_argument("--sample-stacks", type=float, default=0, metavar="MS",
                   help="sample the main thread's stack every MS ms and list the longest stalls (stack_sampler.py)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    probe = Probe()
    sampler = StackSampler(args.sample_stacks).start() if args.sample_stacks else None
    trained = profile_train(args.profile_train) if args.profile_train else {}
    with tempfile.TemporaryDirectory() as work:
        checkpoint = os.path.join(work, "checkpoint")
        grpo_step.make_checkpoint(args.shape, checkpoint, torch.bfloat16, args.device)
        vocab = json.load(open(os.path.join(checkpoint, "config.json")))["vocab_size"]
        prompts = grpo_step.prompt_texts(vocab, args.prompts)
        run = grpo_step.run_unison(checkpoint, prompts, args.new, args.steps, os.path.join(work, "run"),
                                   ["save_final=false", *args.unison_set])
    stalls = []
    if sampler is not None:
        sampler.stop()
        warm = probe.trains[0]["span"][1] if probe.trains else 0.0  # compiles and captures before: not stalls
        stalls = [{"in": phase_of(e["t"], probe), **e} for e in sampler.episodes(after=warm)]
    rows = [summary(r) for r in probe.rollouts]
    print("rollout  total s  in steps s  between s  median step ms  compiled  slowest steps (index, ms, running, "
          "compiles)")
    for i, r in enumerate(rows, 1):
        print(f"{i:7d}  {r['total_s']:7.3f}  {r['in_steps_s']:10.3f}  {r['between_steps_s']:9.3f}  "
              f"{r['median_step_ms']:14.3f}  {len(r['compiled']):8d}  {r['slowest']}")
        print(f"         host ms {r['host_ms']}  gc ms {r['gc_ms']}  compiled {r['compiled']}  allocator "
              f"{r['allocator']}")
    print("train_s of every step:", [round(s["train_s"], 4) for s in run["every_step"]])
    print("every training step (s, allocator counts, collections, compiles):", probe.trains)
    if trained:
        print("profiled training step:", json.dumps(trained))
    print("full collections:", probe.full_collections)
    for e in stalls:
        print(f"stall: {e['kind']} {e['ms']} ms in {e['in']}:", " <- ".join(e["stack"][:8]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "shape": args.shape, "overrides": args.unison_set,
                       "every_step": run["every_step"],
                       "rollouts": rows, "train_allocator": probe.trains, "profiled_train_step": trained,
                       "stalls": stalls, "full_collections": probe.full_collections}, f,
                      indent=1)


if __name__ == "__main__":
    main()
