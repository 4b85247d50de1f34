"""Where the GPU waits in the GRPO loop's training steps, without a profiler: at marks inside ``train_step``
(packing, each row's forward and loss, the optimizer) the host's time and the time the GPU reached the same point
in its stream (a CUDA event recorded there), both from the step's start. Where the two are equal the GPU had run
out of work and waited on the host; where the GPU's is later, the host was ahead by the difference.

    python bench/train_events.py --shape qwen3-0.6b --steps 5 [--events-json events.json] [rollout_steps options]

The run is ``rollout_steps.py``'s (bench/grpo_step.py's workload), whose options it takes. Printed per step as
``mark:host_ms/gpu_ms``; between a row's ``loss>`` and the next ``fwd<`` (or ``opt<``) the host launched that
row's backward. Where the loss is a sum over tokens, ``fwd`` includes the lm_head's gradient (``policy_loss``) and
``loss`` only the metrics. CUDA only.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import rollout_steps  # noqa: E402

import unison.train.loop as train_loop  # noqa: E402
import unison.train.step as step_module  # noqa: E402


class Marks:
    """Host time and a recorded CUDA event per mark, for the step under way (``current``)."""

    def __init__(self):
        self.current: list | None = None
        self.steps: list[dict] = []

    def mark(self, name: str) -> None:
        if self.current is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.current.append((name, time.perf_counter(), event))

    def around(self, module, attr: str, before: str, after: str) -> None:
        fn = getattr(module, attr)

        def wrapped(*args, **kwargs):
            self.mark(before)
            out = fn(*args, **kwargs)
            self.mark(after)
            return out
        setattr(module, attr, wrapped)

    def install(self) -> None:
        for attr, before, after in (("pack_samples", "pack<", "pack>"), ("policy_logprobs", "fwd<", "fwd>"),
                                    ("policy_loss", "fwd<", "fwd>"), ("grpo_loss", "loss<", "loss>"),
                                    ("_optimizer_step", "opt<", "opt>")):
            self.around(step_module, attr, before, after)
        train_step = train_loop.train_step

        def timed(*args, **kwargs):
            torch.cuda.synchronize()
            self.current = []
            self.mark("entry")
            out = train_step(*args, **kwargs)
            self.mark("exit")
            torch.cuda.synchronize()
            (_, h0, e0), done = self.current[0], time.perf_counter()
            self.steps.append({"marks": [(n, round((h - h0) * 1e3, 2), round(e0.elapsed_time(e), 2))
                                         for n, h, e in self.current],
                               "host_exit_ms": round((done - h0) * 1e3, 2)})
            self.current = None
            return out
        train_loop.train_step = timed


def main():
    events_json = None
    if "--events-json" in sys.argv:
        i = sys.argv.index("--events-json")
        events_json = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    marks = Marks()
    marks.install()
    rollout_steps.main()
    for i, step in enumerate(marks.steps, 1):
        print(f"train step {i}: returned after {step['host_exit_ms']:.1f} ms (host, synchronized)")
        print("   " + "  ".join(f"{n}:{h:.1f}/{g:.1f}" for n, h, g in step["marks"]))
    if events_json:
        with open(events_json, "w") as f:
            json.dump(marks.steps, f, indent=1)


if __name__ == "__main__":
    main()
