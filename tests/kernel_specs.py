"""The Triton kernels a piece of code launches, recorded where they run in Triton's interpreter (the CPU tests), and
compiled for a GPU that this machine does not have.

The interpreter accepts programs that Triton's compiler rejects (a type that does not unify, a constexpr used as a
value, an operation a target lacks), so a kernel that passes every CPU test could still fail to compile on the
GPU. ``record()`` notes each launch's kernel and its arguments' kinds (a tensor's dtype and 16-byte alignment, a
scalar's value, the options); run as a script, this file compiles each recorded variant with Triton's own JIT
path (``JITFunction.warmup``: the same specialisation and options a launch on the GPU gets) for the targets named,
through a driver that only names the target, and prints one line a variant:

    python tests/kernel_specs.py specs.json 90 80
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time

TRITON_ENV = {"TRITON_INTERPRET": None, "TRITON_DEFAULT_FP_FUSION": "1"}
"""The compiling process's environment: Triton compiles (it does not interpret), with the fp fusion default the
GPU's Triton has (our kernels that must not fuse say so themselves: ``enable_fp_fusion=False``)."""


def _spec(value) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0]
    if value is None or isinstance(value, (bool, int, float, str)):
        return ["value", value]
    raise TypeError(f"kernel_specs: an argument of type {type(value).__name__} (record tensors and scalars only)")


@contextlib.contextmanager
def record(specs: dict):
    """Within the block, every interpreted Triton launch adds its variant to ``specs`` (keyed by the variant)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        entry = {"module": self.fn.__module__, "name": self.fn.__name__, "args": [_spec(a) for a in args],
                 "kwargs": {k: _spec(v) for k, v in sorted(kwargs.items())}}
        specs.setdefault(json.dumps(entry, sort_keys=True), entry)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    try:
        yield specs
    finally:
        InterpretedFunction.run = original


def _argument(spec: list, keep: list):
    import torch

    if spec[0] != "tensor":
        return spec[1]
    base = torch.empty(64, dtype=getattr(torch, spec[1]))
    keep.append(base)
    return base if spec[2] else base[1:]  # a misaligned pointer where the launch had one


def compile_all(entries: list[dict], capability: int) -> list[tuple[str, str | None, float]]:
    """(kernel, None or the compiler's error, seconds) for each entry, compiled for ``sm_<capability>``."""
    import triton.runtime as runtime
    from triton.backends.compiler import GPUTarget

    class TargetOnly:  # all a JIT warmup asks of the driver
        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):  # a JIT function keeps its compiled variants per device: one per target
            return capability

        def get_current_stream(self, device=None):
            return 0

    runtime.driver.set_active(TargetOnly())
    results, keep = [], []
    for entry in entries:
        kernel = getattr(importlib.import_module(entry["module"]), entry["name"])
        start = time.perf_counter()
        try:
            kernel.warmup(*[_argument(a, keep) for a in entry["args"]], grid=(1,),
                          **{k: _argument(v, keep) for k, v in entry["kwargs"].items()})
            error = None
        except Exception as e:  # noqa: BLE001  (the compiler's error is the result)
            error = f"{type(e).__name__}: {e}"
        results.append((f"{entry['module']}.{entry['name']}", error, time.perf_counter() - start))
    return results


def main(path: str, capabilities: list[int]) -> int:
    entries = json.load(open(path))
    failed = 0
    for capability in capabilities:
        for name, error, seconds in compile_all(entries, capability):
            print(f"sm_{capability} {'ok  ' if error is None else 'FAIL'} {name} {seconds:.2f} s"
                  + (f"\n{error}" if error else ""))
            failed += error is not None
    print(f"{len(entries) * len(capabilities) - failed} of {len(entries) * len(capabilities)} compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("kernel_specs: run without TRITON_INTERPRET (it compiles)")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    sys.exit(main(sys.argv[1], [int(c) for c in sys.argv[2:]] or [90]))
