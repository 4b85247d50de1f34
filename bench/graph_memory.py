"""What the engine's captured graphs hold on the GPU: a run that passes every decode batch size of the ladder once
(request i of N stops after i + 2 tokens, so each step decodes one request fewer) and some steps of prompt rows,
with ``torch.cuda.memory_allocated`` (the tensors alive, a graph's outputs and library workspaces among them) and
``memory_reserved`` (the graphs' pool's freed blocks too) after the weights, after the engine's construction (its
static buffers; the KV pool is mapped outside PyTorch's allocator where CUDA's virtual memory serves it) and after
the run, and a decode step's time at 256 and 64. ``--where`` names the lines that allocated what the run holds.

    python bench/graph_memory.py --shape qwen3-0.6b --where --json graph_memory.json

``GRAPHMEM_BASE=1 bash bench/speed_gpu.sh graphmem`` runs it for an older tree's ``unison`` (``build/base``) too.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from engine import SHAPES, build, prompts_for

import unison
from unison.engine import Engine, EngineConfig, SamplingParams


def mib(n: int) -> float:
    return round(n / 2**20, 1)


def step_ms(engine: Engine, prompts: list[list[int]]) -> float:
    """Median time of the last 16 of 32 decode steps of all ``prompts`` at once (graphs captured before)."""
    for p in prompts:
        engine.submit(p, SamplingParams(max_new_tokens=32, temperature=1.0, stop_token_ids=()))
    times = []
    while engine.num_unfinished:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    last = sorted(times[-16:])
    return round(1e3 * last[len(last) // 2], 3)


def live_by_line(top: int = 25) -> dict[str, float]:
    """The live blocks allocated since recording began, summed by the innermost unison/ or bench/ frame of their
    allocation's stack (file:line function), largest first."""
    sums: dict[str, int] = {}
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            frames = block.get("frames") or []
            if block["state"] != "active_allocated" or not frames:
                continue
            ours = [f for f in frames if "/unison/" in f["filename"] or "/bench/" in f["filename"]]
            f = ours[0] if ours else frames[0]
            key = f"{f['filename'].split('/')[-1]}:{f['line']} {f['name']}"
            sums[key] = sums.get(key, 0) + block["size"]
    return {k: mib(v) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])[:top]}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--json")
    p.add_argument("--where", action="store_true",
                   help="record allocations (torch.cuda.memory._record_memory_history) and list the run's live "
                        "tensors by the unison or bench line that allocated them")
    args = p.parse_args()
    model = build(args.shape, "cuda", torch.bfloat16, "unison")
    n, vocab = args.requests, model.config.vocab_size
    blocks = n * -(-(args.prompt + n + 40) // 16) + 8
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    if args.where:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    engine = Engine(model, EngineConfig(num_blocks=blocks, block_size=16, max_num_seqs=n, seed=0))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for i, prompt in enumerate(prompts_for(vocab, n, args.prompt, seed=1)):
        engine.submit(prompt, SamplingParams(max_new_tokens=i + 2, temperature=1.0, stop_token_ids=()))
    while engine.num_unfinished:
        engine.step()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    stats = engine.stats()
    result = {"shape": args.shape, "requests": n, "unison": unison.__file__,
              "graphs_captured": stats["graphs_captured"], "decode_sizes": sorted(engine.runner.graphs),
              "row_sizes": sorted(engine.rows.graphs) if engine.rows is not None else [],
              # after the weights, after the engine (its KV pool, static buffers), after the run
              "allocated_mib": [mib(weights[0]), mib(before[0]), mib(after[0])],
              "reserved_mib": [mib(weights[1]), mib(before[1]), mib(after[1])],
              "engine_allocated_mib": mib(before[0] - weights[0]), "run_allocated_mib": mib(after[0] - before[0]),
              "engine_and_run_allocated_mib": mib(after[0] - weights[0]),
              "engine_and_run_reserved_mib": mib(after[1] - weights[1]),
              "decode_step_ms": {c: step_ms(engine, prompts_for(vocab, c, args.prompt, seed=2 + c))
                                 for c in (n, 64) if c <= n}}
    if args.where:
        result["live_by_line_mib"] = live_by_line()
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
