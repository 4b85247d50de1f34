"""A decode step's projections at decode row counts, per layer: transformers' separate ``nn.Linear`` calls (cuBLAS)
and its SiLU and product, against ``unison.engine.triton_linear``'s kernels (which ``fused_linear`` swaps in) in
several tile configurations and ways of loading their tiles.

    python bench/decode_linear.py --json out.json

Each timing replays a CUDA graph of the projections of 28 layers with distinct weights (one layer's weights fit in
the H200's L2; a decode step reads each layer's once from memory), so launch gaps are those of the engine's
captured step. Prints one line per (shape, rows): microseconds per layer and the roofline (weight bytes at the
measured copy bandwidth), and which configuration was fastest.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from unison.engine import triton_linear

SHAPES = {"qwen3-0.6b": (1024, 2048, 1024, 3072), "qwen3-1.7b": (2048, 2048, 1024, 6144)}  # hidden, q, kv, inter
CONFIGS = [(32, 128, 4, 5), (32, 128, 4, 4), (32, 128, 4, 8), (64, 128, 4, 5), (32, 64, 4, 5), (32, 64, 4, 3),
           (64, 64, 4, 3), (16, 128, 4, 5), (16, 64, 4, 5)]
"""(BLOCK_N, BLOCK_K, num_warps, num_stages) with x through a descriptor (loads "tma"); BLOCK_M covers the rows. The
pointer kernels run their default tiles ("pointer")."""
LAYERS = 28


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of ``fn(layer)`` over LAYERS layers, replayed as one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(LAYERS):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / reps / LAYERS


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    return 2 * x.numel() * 10 / (start.elapsed_time(end) / 1e3)


def measure(m: int, h: int, w: dict[str, list[torch.Tensor]], bandwidth: float) -> dict:
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    wq, wk, wv, wg, wu = (w[k] for k in "qkvgu")
    row = {"rows": m, "qkv_roofline_us": 2 * h * sum(t[0].shape[0] for t in (wq, wk, wv)) / bandwidth * 1e6,
           "mlp_in_roofline_us": 2 * h * 2 * wg[0].shape[0] / bandwidth * 1e6}
    row["qkv_cublas_us"] = graph_us(lambda i: (F.linear(x, wq[i]), F.linear(x, wk[i]), F.linear(x, wv[i])))
    row["mlp_in_cublas_us"] = graph_us(lambda i: F.silu(F.linear(x, wg[i])) * F.linear(x, wu[i]))
    wo, wd = w["o"], w["d"]
    xo = torch.randn(m, wo[0].shape[1], device="cuda", dtype=torch.bfloat16)
    xd = torch.randn(m, wd[0].shape[1], device="cuda", dtype=torch.bfloat16)
    row["o_roofline_us"] = 2 * wo[0].numel() / bandwidth * 1e6
    row["down_roofline_us"] = 2 * wd[0].numel() / bandwidth * 1e6
    row["o_cublas_us"] = graph_us(lambda i: F.linear(xo, wo[i]))
    row["down_cublas_us"] = graph_us(lambda i: F.linear(xd, wd[i]))
    block_m = triton_linear.tiles(m)[0]
    calls = {"qkv": lambda i, c, lo: triton_linear.project(x, [wq[i], wk[i], wv[i]], config=c, loads=lo),
             "mlp_in": lambda i, c, lo: triton_linear.gated(x, wg[i], wu[i], config=c, loads=lo),
             "o": lambda i, c, lo: triton_linear.linear(xo, wo[i], config=c, loads=lo),
             "down": lambda i, c, lo: triton_linear.linear(xd, wd[i], config=c, loads=lo)}
    for name, call in calls.items():
        timings = {}
        for label, cfg, loads in [("default", None, None), ("pointer", None, "pointer"),
                                  *((f"tma{c}", (block_m, *c), "tma") for c in CONFIGS)]:
            try:
                timings[label] = graph_us(lambda i, call=call, cfg=cfg, loads=loads: call(i, cfg, loads))
            except Exception as e:  # a configuration that does not fit (shared memory, registers)
                timings[label] = f"{type(e).__name__}"
        numeric = {k: v for k, v in timings.items() if isinstance(v, float)}
        row[f"{name}_fused_us"] = timings
        row[f"{name}_best"] = min(numeric, key=numeric.get)
        row[f"{name}_best_us"] = numeric[row[f"{name}_best"]]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    bandwidth = copy_bandwidth()
    results = []
    for shape, (h, q, kv, inter) in SHAPES.items():
        widths = {"q": (q, h), "k": (kv, h), "v": (kv, h), "g": (inter, h), "u": (inter, h), "o": (h, q),
                  "d": (h, inter)}
        w = {k: [torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) / kk**0.5 for _ in range(LAYERS)]
             for k, (n, kk) in widths.items()}
        for m in args.rows:
            row = {"shape": shape, **measure(m, h, w, bandwidth)}
            results.append(row)
            print(f"{shape} rows {m:3d}: qkv cublas {row['qkv_cublas_us']:.1f} fused "
                  f"{row['qkv_fused_us']['default']:.1f} best {row['qkv_best_us']:.1f} ({row['qkv_best']}) roofline "
                  f"{row['qkv_roofline_us']:.1f} | mlp-in cublas {row['mlp_in_cublas_us']:.1f} fused "
                  f"{row['mlp_in_fused_us']['default']:.1f} best {row['mlp_in_best_us']:.1f} ({row['mlp_in_best']}) "
                  f"roofline {row['mlp_in_roofline_us']:.1f}", flush=True)
            print(f"{'':10s} rows {m:3d}: o cublas {row['o_cublas_us']:.1f} fused {row['o_fused_us']['default']:.1f} "
                  f"best {row['o_best_us']:.1f} ({row['o_best']}) roofline {row['o_roofline_us']:.1f} | down cublas "
                  f"{row['down_cublas_us']:.1f} fused {row['down_fused_us']['default']:.1f} best "
                  f"{row['down_best_us']:.1f} ({row['down_best']}) roofline {row['down_roofline_us']:.1f}", flush=True)
        del w
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bytes_per_s": bandwidth, "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
