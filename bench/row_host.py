"""The host's part of a step of prompt chunks as graph rows (``RowRunner.__call__``: the rows' tokens, positions,
slots and block tables, their copy to the device) with the graph replay stubbed out, on any machine:

    python bench/row_host.py --json bench/results/cpu/row_host.json

Shapes: a multi-turn step (64 chunks of 32 tokens at context 480: 2048 rows) and a GRPO rollout's prompts (8 x 64
at context 0). Tiny Qwen3 weights (only the runner's buffers matter), Triton's interpreter for the engine's setup.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ["UNISON_ROW_GRAPHS"] = "1"
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from conftest import tiny_qwen3  # noqa: E402

from unison.engine import Engine, EngineConfig, SamplingParams, row_graphs  # noqa: E402
from unison.engine.scheduler import Request, ScheduledChunk  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    engine = Engine(tiny_qwen3(), EngineConfig(num_blocks=4096, block_size=16, seed=0, attention="triton",
                                               max_num_seqs=64, max_model_len=2048))
    rows = engine.rows
    results = []
    for n, length, context in ((64, 32, 480), (8, 64, 0)):
        chunks = []
        for i in range(n):
            req = Request(f"r{i}", "g", list(range(10, 10 + context + length)), SamplingParams(), frozenset(), 4096, i)
            req.blocks = list(range(i * 40, i * 40 + -(-(context + length) // 16)))
            chunks.append(ScheduledChunk(req, context, length))
        b = next(size for size in row_graphs.ROW_LADDER if size >= n * length)
        rows.graphs[b] = (None, lambda: rows.logits)  # the forward stubbed: what is left is the host's work
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            rows(chunks)
            times.append(time.perf_counter() - t0)
        times.sort()
        results.append({"chunks": n, "length": length, "context": context, "rows": n * length,
                        "median_ms": 1e3 * times[len(times) // 2], "min_ms": 1e3 * times[0]})
        print(f"{n} x {length} at {context}: median {results[-1]['median_ms']:.3f} ms, min {results[-1]['min_ms']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=1)


if __name__ == "__main__":
    main()
