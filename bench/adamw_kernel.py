"""The optimizer's one-launch AdamW + write-back kernel (``unison.train.triton_adamw.MultiTensorStep``) alone, on
every parameter of a Qwen3 shape: milliseconds and bandwidth (32 bytes a parameter: bf16 gradient and parameter
read, fp32 master and moments read and written, bf16 parameter and the changed mask written), for launch
configurations, and against another tree's kernel (``--base DIR``: that tree's ``unison/train/triton_adamw.py``)
with a bit-for-bit check of every output.

    python bench/adamw_kernel.py --shape qwen3-0.6b [--base build/base] --json adamw_kernel.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics

import torch
from engine import SHAPES

import unison.train.triton_adamw as kernel_module

DEFAULTS = {True: (kernel_module._MULTI_BLOCK, kernel_module._CHUNK_BLOCKS, kernel_module._WARPS),
            False: (2048, 4, 8)}  # this tree's launch configuration; 896e9d6's
SCALARS = dict(grad_scale=0.5, decay=1.0, beta1=0.9, beta2=0.999, step_size=1e-5 / (1 - 0.9**3),
               bc2_sqrt=(1 - 0.999**3) ** 0.5, eps=1e-8)


def param_shapes(s: dict) -> list[tuple[int, ...]]:
    h, inter, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    layer = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter), (h,), (h,), (d,), (d,)]
    return [(s["vocab_size"], h), *layer * s["num_hidden_layers"], (h,)]


def state(shapes, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = (lambda shape, dtype, scale: (torch.randn(shape, generator=g, device="cuda") * scale).to(dtype))
    masters = [make(x, torch.float32, 0.02) for x in shapes]
    return dict(masters=masters, exp_avgs=[make(x, torch.float32, 1e-3) for x in shapes],
                exp_avg_sqs=[make(x, torch.float32, 1e-6).abs() for x in shapes],
                params=[m.to(torch.bfloat16) for m in masters], grads=[make(x, torch.bfloat16, 1e-3) for x in shapes])


def configure(module, block, chunk, warps):
    """Sets ``module``'s launch configuration. A tree from before ``_MULTI_BLOCK`` and ``_WARPS`` (896e9d6) reads
    ``_BLOCK`` and launches 8 warps."""
    if hasattr(module, "_MULTI_BLOCK"):
        module._MULTI_BLOCK, module._CHUNK_BLOCKS, module._WARPS = block, chunk, warps
    else:
        module._BLOCK, module._CHUNK_BLOCKS = block, chunk


def timed(module, st, block, chunk, warps, repeats=10):
    configure(module, block, chunk, warps)
    step = module.MultiTensorStep(st["masters"], st["exp_avgs"], st["exp_avg_sqs"], st["params"])
    step(st["grads"], SCALARS)  # compile
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step(st["grads"], SCALARS)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def outputs(module, shapes):
    st = state(shapes, seed=1)
    configure(module, *DEFAULTS[module is kernel_module])
    changed = module.MultiTensorStep(st["masters"], st["exp_avgs"], st["exp_avg_sqs"], st["params"])(
        st["grads"], SCALARS)
    return [*st["masters"], *st["exp_avgs"], *st["exp_avg_sqs"], *st["params"], *changed]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--base", default=None, help="another tree's root: its kernel timed beside this one")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    shapes = param_shapes(SHAPES[args.shape])
    numel = sum(torch.Size(x).numel() for x in shapes)
    modules = {"this tree": kernel_module}
    if args.base:
        spec = importlib.util.spec_from_file_location(
            "base_triton_adamw", os.path.join(args.base, "unison", "train", "triton_adamw.py"))
        modules["base"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules["base"])
    st = state(shapes)
    rows = []
    configs = [DEFAULTS[True], (2048, 4, 8), (1024, 4, 4), (4096, 2, 16)]
    for name, module in modules.items():
        for block, chunk, warps in configs if name == "this tree" else [DEFAULTS[False]]:
            ms = timed(module, st, block, chunk, warps)
            rows.append({"kernel": name, "block": block, "chunk_blocks": chunk, "warps": warps, "ms": round(ms, 3),
                         "tb_per_s": round(32 * numel / ms / 1e9, 2)})
            print(f"{name:9s} block {block:5d} x {chunk} warps {warps:2d}: {ms:.3f} ms, {rows[-1]['tb_per_s']} TB/s")
    same = None
    if args.base:
        ours, theirs = outputs(kernel_module, shapes), outputs(modules["base"], shapes)
        same = all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
        print("every master, moment, parameter and mask the same bits as base's:", same)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape, "params": numel,
                       "bytes_per_param": 32, "rows": rows, "same_bits_as_base": same}, f, indent=1)


if __name__ == "__main__":
    main()
