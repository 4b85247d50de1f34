"""Registers and shared memory of the decode attention kernels as the GPU runs them, found on a machine without one:
the launches are recorded in Triton's interpreter (``tests/kernel_specs.py``), switched to the GPU's variant (no fp32
upcast; programmatic launch), compiled for sm_90 and read back from the cubin with the ``cuobjdump`` Triton ships.
A kernel's occupancy follows: the engine's decode kernel runs 4 programs a multiprocessor on an H200 (Nsight
Compute, bench/results/h200/speed/attention/), limited by its registers and shared memory.

    python bench/kernel_resources.py          # CPU; prints one line a variant
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def record() -> list[dict]:
    """The engine's two decode attention kernels at the 0.6B heads, launched in the interpreter."""
    import torch
    from kernel_specs import record as recording
    from test_rope_decode import _case, _norms

    from unison.engine.rope_decode import rope_paged_decode
    from unison.engine.triton_attention import paged_decode

    specs: dict = {}
    with recording(specs):
        for norm in (True, False):
            q, k, v, cos, sin, kp, vp, slots, tables, lens = _case(16, 8, 128, 16, [5, 70, 300], torch.bfloat16)
            q_norm, k_norm = _norms(128, torch.bfloat16) if norm else (None, None)
            rope_paged_decode(q, k, v, cos, sin, kp, vp, slots, tables, lens, 16, 128**-0.5, None, q_norm, k_norm)
        paged_decode(q, kp, vp, tables, lens, 16, 128**-0.5)
    entries = [e for e in specs.values() if "UPCAST" in e["kwargs"]]
    for e in entries:
        e["kwargs"].update(UPCAST=["value", False], PDL=["value", True])
    return entries


def compile_and_read(entries: list[dict]) -> None:
    import triton
    import triton.runtime as runtime
    from kernel_specs import _argument
    from triton.backends.compiler import GPUTarget

    class TargetOnly:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 90

        def get_current_stream(self, device=None):
            return 0

    runtime.driver.set_active(TargetOnly())
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    keep: list = []
    for e in entries:
        kernel = getattr(importlib.import_module(e["module"]), e["name"])
        compiled = kernel.warmup(*[_argument(a, keep) for a in e["args"]], grid=(1,),
                                 **{k: _argument(v, keep) for k, v in e["kwargs"].items()})
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        regs = next((w for line in usage.splitlines() for w in line.split() if w.startswith("REG:")), "REG:?")
        norm = e["kwargs"].get("NORM", ["value", None])[1]
        print(f"{e['name']:22s} NORM={norm!s:5s} {regs}  shared {compiled.metadata.shared} B  "
              f"warps {compiled.metadata.num_warps}")


def main():
    if len(sys.argv) > 1:  # the compiling process: Triton compiles here, it does not interpret
        compile_and_read(json.load(open(sys.argv[1])))
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    entries = record()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(entries, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=tempfile.mkdtemp())
    subprocess.run([sys.executable, __file__, f.name], env=env, check=True)


if __name__ == "__main__":
    main()
