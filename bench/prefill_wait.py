"""How many eager steps a multi-turn rollout's scheduling makes, by ``EngineConfig.prefill_wait_steps``: the
engine's own Scheduler and BlockAllocator, stepped as the engine steps them, on episodes whose turns end at
different steps (no model: with no stop tokens a turn's length is its ``max_new_tokens``, so which chunks each step
computes does not depend on the tokens). A step whose chunks are all one-token decodes is a CUDA-graph step on the
GPU; any other step runs eagerly, host-bound, at many times the cost.

    python bench/prefill_wait.py --json bench/results/cpu/prefill_wait.json
    python bench/prefill_wait.py --refill 64 --prompt 128 --min-turn 64 --max-turn 1024   # single-turn GRPO, refilled

Reported per wait: engine steps, eager steps, and the time they would take at ``--graph-ms`` a decode step and
``--eager-ms`` an eager one. The defaults are fitted to ``bench/multiturn.py --stagger`` on one H200 at the Qwen3-0.6B
shape and 64 episodes (bench/results/h200/speed/multiturn: waits 0 / 16 / 64 took 5.38 / 1.51-1.60 / 1.17 s over
382 / 404 / 459 steps of which 136 / 28 / 16 eager; 1.37 ms a decode step and 37 ms an eager one fit the first two and
predict 1.20 s for the third). That time is a prediction from step counts.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from unison.engine.cache import BlockAllocator
from unison.engine.scheduler import Request, Scheduler
from unison.engine.types import SamplingParams


def episodes_run(wait: int, n: int, prompt: int, turns: int, lengths: tuple[int, int], appended: int,
                 block: int, budget: int, seed: int) -> dict:
    """``n`` continuable episodes of ``turns`` turns, each turn of its own length, each reply of ``appended`` tokens
    appended as soon as the turn ends (extend, as the episode loop does)."""
    rng = random.Random(seed)
    turn_lengths = [[rng.randint(*lengths) for _ in range(turns)] for _ in range(n)]
    total = prompt + sum(max(t) for t in zip(*turn_lengths, strict=True)) + turns * appended + turns
    s = Scheduler(BlockAllocator(n * (-(-total // block) + 1)), block, budget, max_num_seqs=n, prefix_caching=False,
                  prefill_wait=wait)
    turn = [0] * n
    for i in range(n):
        req = Request(f"r{i}", f"g{i}", [3] * prompt, SamplingParams(max_new_tokens=turn_lengths[i][0]),
                      frozenset(), prompt + turn_lengths[i][0], arrival=i)
        req.continuable = True
        s.add(req)

    def finished(req: Request) -> None:
        i = int(req.request_id[1:])
        turn[i] += 1
        if turn[i] < turns:  # the tool's reply appended and the request resumed, as Engine.extend does
            req.prompt, req.output = req.prompt + req.output + [5] * appended, []
            req.max_len = len(req.prompt) + turn_lengths[i][turn[i]]
            s.resume(req)
        else:
            s.release(req.request_id)
    return {"prefill_wait_steps": wait} | run_steps(s, finished)


def refill_run(wait: int, concurrent: int, group: int, groups: int, prompt: int, lengths: tuple[int, int],
               block: int, budget: int, seed: int) -> dict:
    """Single-turn GRPO with refill (``RolloutLoop._fill``): ``concurrent`` samples in flight, a new group of
    ``group`` samples submitted whenever a group's last sample lands, ``groups`` groups in all; each sample's
    completion of its own length (stop tokens at different steps)."""
    rng = random.Random(seed)
    s = Scheduler(BlockAllocator(concurrent * (-(-(prompt + lengths[1]) // block) + 1)), block, budget,
                  max_num_seqs=concurrent, prefix_caching=False, prefill_wait=wait)
    submitted, left = 0, {}

    def submit() -> None:
        nonlocal submitted
        for j in range(group):
            new = rng.randint(*lengths)
            s.add(Request(f"r{submitted}-{j}", f"g{submitted}", [3] * prompt, SamplingParams(max_new_tokens=new),
                          frozenset(), prompt + new, arrival=submitted * group + j))
        left[f"g{submitted}"] = group
        submitted += 1

    for _ in range(concurrent // group):
        submit()

    def finished(req: Request) -> None:
        left[req.group_id] -= 1
        if left[req.group_id] == 0 and submitted < groups:
            submit()
    return {"prefill_wait_steps": wait} | run_steps(s, finished)


def run_steps(s: Scheduler, finished) -> dict:
    """Step ``s`` as the engine does until nothing is left, each sampling chunk's request given a token;
    ``finished(request)`` for each that reached its length (after ``s.finish``). Returns the step counts."""
    counts = {"steps": 0, "eager_steps": 0, "held_steps": 0}
    while s.waiting or s.running:
        hold = s.holds()
        chunks = s.schedule(hold)
        s.after_forward(chunks)
        counts["steps"] += 1
        counts["held_steps"] += hold
        counts["eager_steps"] += not all(c.length == 1 and c.samples for c in chunks)
        for c in chunks:
            if c.samples:
                c.request.output.append(7)
                if c.request.num_tokens >= c.request.max_len:
                    s.finish(c.request)
                    finished(c.request)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=64, help="episodes")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--min-turn", type=int, default=32, help="a turn's tokens: uniform in [min, max]")
    ap.add_argument("--max-turn", type=int, default=256)
    ap.add_argument("--appended", type=int, default=64, help="a tool reply's tokens")
    ap.add_argument("--budget", type=int, default=2048, help="EngineConfig.max_batch_tokens")
    ap.add_argument("--waits", default="0,16,32,64,128")
    ap.add_argument("--graph-ms", type=float, default=1.37)
    ap.add_argument("--eager-ms", type=float, default=37.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--refill", type=int, default=0, metavar="GROUPS",
                    help="single-turn GRPO with refill instead: this many groups of 8 through --n samples at once "
                         "(completions of --min-turn to --max-turn tokens)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    workload = {k: getattr(a, k) for k in ("n", "prompt", "turns", "min_turn", "max_turn", "appended", "budget",
                                             "graph_ms", "eager_ms", "seeds", "refill")}
    rows = []
    for wait in (int(w) for w in a.waits.split(",")):
        runs = [refill_run(wait, a.n, 8, a.refill, a.prompt, (a.min_turn, a.max_turn), 16, a.budget, seed)
                if a.refill else
                episodes_run(wait, a.n, a.prompt, a.turns, (a.min_turn, a.max_turn), a.appended, 16, a.budget, seed)
                for seed in range(a.seeds)]
        row = {"prefill_wait_steps": wait}
        for key in ("steps", "eager_steps", "held_steps"):
            row[key] = sum(r[key] for r in runs) / len(runs)
        row["predicted_s"] = ((row["steps"] - row["eager_steps"]) * a.graph_ms + row["eager_steps"] * a.eager_ms) / 1e3
        rows.append(row)
    base = rows[0]["predicted_s"]
    print(f"{'wait':>5} {'steps':>7} {'eager':>7} {'held':>7} {'predicted s':>12} {'vs first':>9}")
    for r in rows:
        print(f"{r['prefill_wait_steps']:>5} {r['steps']:>7.1f} {r['eager_steps']:>7.1f} {r['held_steps']:>7.1f} "
              f"{r['predicted_s']:>12.3f} {base / r['predicted_s']:>8.2f}x")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"workload": workload, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
