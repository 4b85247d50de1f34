"""Where prompt chunks as graph rows (unison/engine/row_graphs.py) beat the eager step: one step of N chunks of L
tokens each, continuing conversations of C tokens (``Engine.extend``: a tool reply appended), timed with the rows
and eagerly, alternating, over a grid of N, L and C. Rows read ``L * (C + (L + 1) / 2)`` keys a chunk a layer where
the eager step's flash reads each of the ``C + L`` once: the crossover sets ``row_graphs.ROW_KV_BYTES``.

    python bench/row_steps.py --shape qwen3-0.6b --json row_steps.json
    python bench/row_steps.py --device cpu --shape tiny --n 2 --lengths 8 --contexts 0 16   # a smoke run

The ladder is taken up to ``--max-rows`` for the sweep and the key and parameter budgets lifted, so every point runs
both ways (the 0.6B and 1.7B sweeps in bench/results/h100/speed/rows/ set ``ROW_KV_BYTES`` and ``ROW_TOKEN_PARAMS``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("UNISON_ROW_GRAPHS", "1")

import torch  # noqa: E402
from engine import SHAPES, build, prompts_for, sync  # noqa: E402

from unison.engine import Engine, EngineConfig, SamplingParams, row_graphs  # noqa: E402

ONE = SamplingParams(max_new_tokens=1, temperature=1.0, stop_token_ids=())


def finish(engine: Engine) -> list[str]:
    ids = []
    while engine.num_unfinished:
        ids += [c.request_id for c in engine.step()]
    return ids


def timed_step(engine: Engine, ids: list[str], length: int, vocab: int, seed: int, rows: bool) -> tuple[float, bool]:
    """Extend every request by ``length - 1`` tokens (its last sampled token is the chunk's first) and time the step
    that prefills them: (seconds, whether it ran as rows)."""
    runner = engine.rows
    engine.rows = runner if rows else None
    g = torch.Generator().manual_seed(seed)
    for rid in ids:
        engine.extend(rid, torch.randint(10, vocab, (length - 1,), generator=g).tolist(), ONE)
    before = engine.stats()["row_graph_steps"]
    sync(engine.device.type)
    t0 = time.perf_counter()
    engine.step()
    sync(engine.device.type)
    seconds = time.perf_counter() - t0
    took = engine.stats()["row_graph_steps"] > before
    finish(engine)
    engine.rows = runner
    return seconds, took


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--n", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024, 2048])
    p.add_argument("--max-rows", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)  # each a step with rows and one without
    p.add_argument("--json", default=None)
    args = p.parse_args()
    row_graphs.ROW_LADDER = tuple(sorted({*row_graphs.ROW_LADDER, *(b for b in (768, 1024, 1536, 2048, 3072, 4096)
                                                                     if b <= args.max_rows)}))
    row_graphs.ROW_KV_BYTES = row_graphs.ROW_TOKEN_PARAMS = float("inf")
    model = build(args.shape, args.device, torch.bfloat16, "unison")
    vocab = model.config.vocab_size
    longest = max(args.contexts) + (args.reps + 1) * 2 * sum(args.lengths) + 16
    n_max = max(args.n)
    engine = Engine(model, EngineConfig(num_blocks=n_max * (-(-longest // 16) + 1) + 8, block_size=16, seed=0,
                                        max_model_len=longest, max_num_seqs=max(n_max, 64),
                                        max_batch_tokens=max(8192, n_max * max(args.lengths)),
                                        prefill_wait_steps=0,
                                        **({"attention": "triton"} if args.device == "cpu" else {})))
    assert engine.rows is not None, "the engine took no RowRunner (UNISON_ROW_GRAPHS, or a model it excludes)"
    key_bytes = engine.rows.key_bytes
    layers = len(engine.pool.layers)
    results = []
    print(f"{'n':>4} {'L':>4} {'C':>5} {'rows':>5} {'KV MB/layer':>11} {'eager ms':>9} {'rows ms':>8} {'x':>6}")
    for n in args.n:
        for c in args.contexts:
            ids = [engine.submit(pr, ONE, continuable=True)[0] for pr in prompts_for(vocab, n, c - 1, seed=c)]
            finish(engine)
            context = c  # tokens a request holds: its KV covers all but the last sampled one
            for length in args.lengths:
                if n * length > engine.rows.max_rows:
                    continue
                times, keys = {True: [], False: []}, []
                for rep in range(args.reps + 1):  # the first pair warms up (captures the row count's graph)
                    for rows in (True, False):
                        s, took = timed_step(engine, ids, length, vocab, seed=rep, rows=rows)
                        assert took == rows
                        if rep:  # row p of the chunk at context - 1 .. context + length - 2 reads p + 1 keys
                            times[rows].append(s)
                            keys.append(n * length * (context + (length - 1) / 2))
                        context += length
                kv = sum(keys) / len(keys) * 2 * key_bytes  # keys and values
                eager, graph = (1e3 * sorted(times[k])[len(times[k]) // 2] for k in (False, True))
                results.append({"n": n, "length": length, "context": c, "rows": n * length,
                                "kv_bytes_per_layer": kv, "eager_ms": eager, "rows_ms": graph})
                print(f"{n:>4} {length:>4} {c:>5} {n * length:>5} {kv / 2**20:>11.1f} {eager:>9.2f} {graph:>8.2f} "
                      f"{eager / graph:>6.2f}")
            for rid in ids:
                engine.release(rid)
    summary = {"shape": args.shape, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "layers": layers, "key_bytes": key_bytes, "results": results}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
