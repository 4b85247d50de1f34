"""Host time an eager engine step spends swapping the fused kernels' forwards in and out: ``graphs.fused_kernels``
(walk, check and build every time) against ``swaps.KernelSwaps`` (planned once, then dict writes), on the CPU at a
real decoder's shape (bf16 weights, random; the swapped forwards are not run).

    python bench/swap_cost.py --json bench/results/cpu/swap_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from engine import SHAPES, build  # bench/engine.py

from unison.engine import fused_layer, fused_linear
from unison.engine.graphs import fused_kernels
from unison.engine.swaps import KernelSwaps


def per_call_ms(enter, n: int) -> float:
    for _ in range(10):
        with enter():
            pass
    t = time.perf_counter()
    for _ in range(n):
        with enter():
            pass
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    # as on the GPU: every swap's condition passes (the forwards themselves would run Triton's interpreter here)
    fused_layer.DEVICES = fused_linear.DEVICES = {"cuda", "cpu"}
    decoder = build(a.shape, "cpu", torch.bfloat16, "unison").model
    swaps = KernelSwaps(decoder, fused_kernels)
    result = {"shape": a.shape, "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)",
              "modules": len(list(decoder.modules())),
              "fused_kernels_ms": round(per_call_ms(lambda: fused_kernels(decoder), a.n), 3),
              "planned_ms": round(per_call_ms(swaps, a.n), 3), "plans": swaps.plans,
              "swapped": len(swaps._writes)}
    print(json.dumps(result, indent=2))
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
