"""The fused sampler's grid at a decode step's rows: microseconds a call of ``FusedSampler`` (its two kernels and the
parameters' copy, replayed in one CUDA graph of 20 calls) for vocabulary tiles (``block_v``) and the programs it
aims for (``target_programs``; a part's tile count is a power of two, so 64 rows of a 151,936-word vocabulary
take 5 parts of 16 tiles at the default 512). fp32 logits, as the engine's lm_head gives them.

    python bench/sampler_parts.py --json sampler_parts.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_kernel import graph_us  # noqa: E402

from unison.engine.triton_sampler import FusedSampler  # noqa: E402

VOCAB = 151936


def call_us(sampler: FusedSampler, logits: torch.Tensor, calls: int = 20) -> float:
    rows = logits.shape[0]
    return graph_us([functools.partial(sampler, logits, [1.0] * rows, list(range(rows)))] * calls, replays=30)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rows_out = []
    for rows in (64, 256):
        logits = torch.randn(rows, VOCAB, device="cuda") * 3
        ref = FusedSampler(logits.device, rows)(logits, [1.0] * rows, list(range(rows)))[0]
        for block_v in (1024, 2048, 4096):
            for target in (256, 512, 1024, 2048):
                sampler = FusedSampler(logits.device, rows, block_v=block_v, target_programs=target)
                same = torch.equal(sampler(logits, [1.0] * rows, list(range(rows)))[0], ref)
                us = call_us(sampler, logits)
                rows_out.append(dict(rows=rows, block_v=block_v, target_programs=target, us=us, same_tokens=same))
                print(f"{rows:4d} rows  block_v {block_v:5d}  target {target:5d}  {us:7.2f} us  same tokens {same}",
                      flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
