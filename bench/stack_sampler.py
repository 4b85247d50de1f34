"""Where the main thread's host time goes in a stall: a thread samples its Python stack every few milliseconds.

A long stall shows up one of two ways: many samples in a row with the same stack (the main thread sat in one call
that let the sampler run: a wait on the GPU, a lock, a C call that released the GIL), or a gap between samples (a
call that held the GIL throughout; the next sample shows where it returned to). ``episodes`` lists both, longest
first. While the main thread waits in a CUDA backward, the stack is that of the thread running the backward's
Python functions (autograd's device thread), then the main thread's. Used by ``rollout_steps.py --sample-stacks MS``.
"""

from __future__ import annotations

import sys
import threading
import time


class StackSampler:
    def __init__(self, every_ms: float = 2.0, depth: int = 14):
        self.every_s, self.depth = every_ms / 1e3, depth
        self.samples: list[tuple[float, tuple[str, ...]]] = []
        self._target = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> StackSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.every_s):
            frames = sys._current_frames()
            stack = self._frames(frames.get(self._target))
            if stack and "_engine_run_backward" in stack[0]:  # CUDA's backward runs on autograd's device thread
                for ident, frame in frames.items():
                    other = self._frames(frame) if ident not in (me, self._target) else []
                    if other and "_bootstrap" not in other[-1]:  # a thread C++ started, not Python's threading
                        stack = [*other, "(autograd thread) | main:", *stack]
                        break
            self.samples.append((time.perf_counter(), tuple(stack)))

    def _frames(self, frame) -> list[str]:
        stack = []
        while frame is not None and len(stack) < self.depth:
            code = frame.f_code
            stack.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        return stack

    def episodes(self, min_ms: float = 60.0, top: int = 12, after: float = 0.0) -> list[dict]:
        """Stretches of at least ``min_ms`` that start after perf_counter time ``after``: the same stack sampled
        throughout ("same"), or no sample at all ("gap", with the stack sampled right after it). Each with its start
        (perf_counter seconds), length and stack."""
        found = []
        run_start = 0
        for i in range(1, len(self.samples) + 1):
            if i < len(self.samples):
                t, stack = self.samples[i]
                gap_ms = (t - self.samples[i - 1][0]) * 1e3
                if gap_ms >= min_ms:
                    found.append({"kind": "gap", "t": self.samples[i - 1][0], "ms": round(gap_ms, 1),
                                  "stack": list(stack)})
                if stack == self.samples[run_start][1]:
                    continue
            same_ms = (self.samples[i - 1][0] - self.samples[run_start][0]) * 1e3
            if same_ms >= min_ms:
                found.append({"kind": "same", "t": self.samples[run_start][0], "ms": round(same_ms, 1),
                              "stack": list(self.samples[run_start][1])})
            run_start = i
        return sorted((e for e in found if e["t"] >= after), key=lambda e: -e["ms"])[:top]
