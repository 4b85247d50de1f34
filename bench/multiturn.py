"""Multi-turn rollouts: continuing requests on their KV (Engine.extend) against resubmitting each turn's whole
conversation, beside a single-turn rollout of the same generated length, in one run.

    python bench/multiturn.py --device cpu --shape tiny --n 8 --turns 3          # quick
    python bench/multiturn.py --device cuda --json bench/results/h200/multiturn.json

A workload is N conversations of a P-token prompt and T model turns of K tokens each (fixed length, no stop
tokens), each turn but the last followed by M appended "tool" tokens (random ids). Modes: ``extend`` (the turn
continues on the request's own KV), ``resubmit`` (a new request of the whole conversation, as an engine without
extend gets it; the prefix cache serves what it can), ``single`` (one turn of T x K tokens). Reported per mode:
wall seconds, generated tokens/s, tokens the engine computed (prefill + decode) and its prefix-cache hit rate.
Random weights of a named shape, no download. Not a test: numbers.

``--stagger``: each conversation's turns take their own lengths (uniform in [K/4, 7K/4], the same draws for every
mode), so tool replies land on different steps, as with real episodes; ``--waits 0,16`` then runs ``extend`` once
per ``EngineConfig.prefill_wait_steps`` (set on the one engine's scheduler between runs), the eager steps counted,
each after an untimed run of its own (a hold makes other decode batch sizes, whose CUDA graphs are captured then;
each run reports the graphs it captured: on an H100, a first run at 16 after runs at 64 took 3.39 s against 1.36-1.51 s
at 64, bench/results/h100/speed/rope2/).

    python bench/multiturn.py --device cuda --shape qwen3-0.6b --n 64 --prompt 256 --turns 4 --new 64 \
      --appended 32 --stagger --waits 0,16,64 --json multiturn_staggered.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from engine import SHAPES, build  # bench/engine.py

from unison.engine import Engine, EngineConfig, SamplingParams


def make_engine(model, n: int, prompt: int, turns: int, new: int, appended: int, block: int) -> Engine:
    total = prompt + turns * (new + appended)
    return Engine(model, EngineConfig(num_blocks=n * (-(-total // block) + 1) + 8, block_size=block,
                                      max_model_len=total + 8, seed=0))


def run(engine: Engine, mode: str, n: int, prompt: int, turns: int, new: int, appended: int,
        stagger: bool = False) -> dict:
    """One mode on ``engine`` (shared by the modes, so that none pays kernel compilation or graph capture the
    others do not; its prefix cache is emptied first)."""
    engine.weights_updated(engine.version + 1)  # forgets every cached prefix
    vocab = engine.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(n)]
    tool = [[torch.randint(3, vocab, (appended,), generator=g).tolist() for _ in range(turns)] for _ in range(n)]
    lengths = (torch.randint(max(new // 4, 1), new * 7 // 4 + 1, (n, turns), generator=g).tolist() if stagger
               else [[new] * turns for _ in range(n)])
    before = engine.stats() | {"prefix_queries": engine.scheduler.prefix_queries,
                               "prefix_hits": engine.scheduler.prefix_hits}
    single = SamplingParams(max_new_tokens=new * turns, temperature=1.0, stop_token_ids=())
    turn_params = [[SamplingParams(max_new_tokens=k, temperature=1.0, stop_token_ids=()) for k in row]
                   for row in lengths]
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    ids = {engine.submit(p, single if mode == "single" else turn_params[i][0], continuable=mode == "extend")[0]: i
           for i, p in enumerate(prompts)}
    turn = dict.fromkeys(ids, 1)
    generated = 0
    while engine.num_unfinished:
        for c in engine.step():
            generated += len(c.token_ids)
            if mode == "single" or turn[c.request_id] == turns:
                continue
            i, t = ids[c.request_id], turn[c.request_id]
            if mode == "extend":
                engine.extend(c.request_id, tool[i][t - 1], turn_params[i][t])
                turn[c.request_id] += 1
            else:
                (rid,) = engine.submit(c.prompt_ids + c.token_ids + tool[i][t - 1], turn_params[i][t])
                ids[rid], turn[rid] = i, t + 1
    sync()
    wall = time.perf_counter() - t0
    s = engine.stats() | {"prefix_queries": engine.scheduler.prefix_queries,
                          "prefix_hits": engine.scheduler.prefix_hits}
    queries = s["prefix_queries"] - before["prefix_queries"]
    return {"mode": mode, "prefill_wait_steps": engine.scheduler.prefill_wait, "wall_s": wall,
            "generated_tokens": generated, "tokens_per_s": generated / wall,
            "tokens_computed": s["tokens_computed"] - before["tokens_computed"],
            "steps": s["steps"] - before["steps"], "eager_steps": (s["steps"] - s["graph_steps"])
            - (before["steps"] - before["graph_steps"]) - s["row_graph_steps"] + before["row_graph_steps"],
            "row_graph_steps": s["row_graph_steps"] - before["row_graph_steps"],  # prompt chunks as graph rows
            "prefix_cache_hit_rate": (s["prefix_hits"] - before["prefix_hits"]) / max(queries, 1),
            "graphs_captured": s["graphs_captured"] - before["graphs_captured"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--n", type=int, default=128, help="conversations")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    ap.add_argument("--turns", type=int, default=4, help="model turns per conversation")
    ap.add_argument("--new", type=int, default=128, help="tokens per model turn")
    ap.add_argument("--appended", type=int, default=64, help="tool tokens after each turn but the last")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--stagger", action="store_true", help="each conversation's turns of their own lengths")
    ap.add_argument("--waits", default="", help="extend once per EngineConfig.prefill_wait_steps, e.g. 0,16")
    ap.add_argument("--no-warm-waits", dest="warm_waits", action="store_false",
                    help="time each --waits run without running it once first (its graph captures then counted in)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = build(a.shape, a.device, dtype, "unison")
    workload = {k: getattr(a, k) for k in ("shape", "n", "prompt", "turns", "new", "appended", "block", "stagger")}
    engine = make_engine(model, a.n, a.prompt, a.turns, a.new * (7 if a.stagger else 4) // 4, a.appended, a.block)
    modes = ("extend", "resubmit", "single")
    for m in modes:  # warm-up: kernels compiled, every decode batch size's graph captured
        run(engine, m, a.n, a.prompt, 2, 8, a.appended, a.stagger)
    results = [run(engine, m, a.n, a.prompt, a.turns, a.new, a.appended, a.stagger) for m in modes]
    for wait in (int(w) for w in a.waits.split(",") if w):
        engine.scheduler.prefill_wait = wait
        if a.warm_waits:  # the batch sizes this hold makes, captured before it is timed
            run(engine, "extend", a.n, a.prompt, a.turns, a.new, a.appended, a.stagger)
        results.append(run(engine, "extend", a.n, a.prompt, a.turns, a.new, a.appended, a.stagger))
    out = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "workload": workload,
           "results": results}
    print(json.dumps(out, indent=2))
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
