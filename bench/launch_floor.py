"""What one launch in a decode graph costs before it does any work, and how fast one launch can stream a layer-sized
weight from memory: the floors under the decode step's projections (issue 23).

    (cd bench && python launch_floor.py --json out.json)

Each timing replays a CUDA graph of 28 launches (one per layer, each on its own buffer, so every read comes from
memory: 28 x 12 MB is several times the L2) and reports microseconds per launch:

- ``empty``: a one-program kernel that stores one value (the launch alone);
- ``stream/<MB>/<programs>``: <programs> programs read a <MB> MB bf16 buffer once (each a contiguous share, in
  BLOCK-wide loads) and store one sum each: the least time a projection reading that weight can take;
- ``projection/<MB>``: unison's projection kernel (``triton_linear.linear``) on a weight of that size at 64 rows
  (1024 wide in), the real one.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl
from decode_linear import LAYERS, graph_us

from unison.engine import triton_linear


@triton.jit
def _empty(Y):
    tl.store(Y, 1.0)


@triton.jit
def _stream(X, Y, share, BLOCK: tl.constexpr):
    """Program p sums X[p * share : (p + 1) * share] (share a multiple of BLOCK)."""
    p = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    start = p.to(tl.int64) * share
    for i in range(0, share, BLOCK):
        acc += tl.load(X + start + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(Y + p, tl.sum(acc))


def median_us(fn, reps: int = 30) -> float:
    """The median of five ``decode_linear.graph_us`` timings (each a fresh graph of the LAYERS launches)."""
    return statistics.median(graph_us(fn, reps) for _ in range(5))


def size_rows(mb: int, y: torch.Tensor) -> dict[str, float]:
    """The stream launches and the projection kernel over LAYERS weights of ``mb`` MB each."""
    n = mb * 2**20 // 2
    bufs = [torch.randn(n, device="cuda").bfloat16() for _ in range(LAYERS)]
    rows = {}
    for programs in (132, 264, 528, 1056, 2112):
        for block in (1024, 4096):
            share = n // programs // block * block
            if share:
                rows[f"stream/{mb}/{programs}/{block}"] = median_us(
                    lambda i, s=share, b=block, g=programs: _stream[(g,)](bufs[i], y, s, BLOCK=b))
    ws = [b.view(-1, 1024) for b in bufs]
    x = torch.randn(64, 1024, device="cuda").bfloat16()
    rows[f"projection/{mb}"] = median_us(lambda i: triton_linear.linear(x, ws[i]))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    y = torch.zeros(1 << 16, device="cuda")
    rows = {"empty": median_us(lambda i: _empty[(1,)](y))}
    for mb in (4, 8, 12):
        rows.update(size_rows(mb, y))
    for name, us in rows.items():
        mb = int(name.split("/")[1]) if "/" in name else 0
        rate = f"{mb * 2**20 / us / 1e6:6.2f} TB/s" if mb else ""
        print(f"{name:24s} {us:6.2f} us {rate}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "us_per_launch": rows}, f, indent=1)


if __name__ == "__main__":
    main()
