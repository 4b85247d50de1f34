"""What scoring with math-verify costs a single-turn rollout, inline and in reward workers (``rollout.reward_workers``):

    python bench/reward_overlap.py --json bench/results/cpu/reward_overlap.json

Random weights of ``bench/engine.py``'s tiny shape, one torch thread on the CPU (the trainer's host thread; the
workers get the other cores), a word-level tokenizer, a GRPO step's 64 samples (8 prompts x G = 8) of up to
``--new`` tokens a batch. The reward is ``reward_cost.realistic_math``: math-verify on one of ``reward_cost``'s
realistic completions in place of each of the random model's (whose word salad math-verify would reject at once),
so a completion costs what a real one does. Each setting rolls out the same batches from a fresh engine and loop
(same seeds; checked): ``costless`` (the same rewards, known in advance: the floor), ``inline``, ``workers=N``. Per
setting, over ``--batches`` batches after a warm-up one (math-verify's first use, the workers' start): ``next_batch``'s
wall time and ``rollout/reward_wait_s`` (the time the loop spent scoring, or waiting for the workers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from engine import build  # noqa: E402  (bench/engine.py)
from grpo_step import word_tokenizer  # noqa: E402
from reward_cost import costless, realistic_math  # noqa: E402

from unison.engine import Engine, EngineConfig  # noqa: E402
from unison.rollout.loop import RolloutConfig, RolloutLoop  # noqa: E402


def rollout(a, model, reward, workers: int) -> tuple[list[float], list[float], list]:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt": " ".join(f"w{i}" for i in torch.randint(3, vocab, (a.prompt,), generator=g).tolist()),
             "answer": str(int(torch.randint(1, 1000, (1,), generator=g)))} for _ in range(64)]
    engine = Engine(model, EngineConfig(num_blocks=a.samples * ((a.prompt + a.new) // 16 + 2), block_size=16,
                                        max_model_len=a.prompt + a.new, seed=0))
    cfg = RolloutConfig(group_size=8, samples_per_step=a.samples, max_concurrent_rollouts=a.samples,
                        max_new_tokens=a.new, reward_workers=workers)
    loop = RolloutLoop(engine, word_tokenizer(vocab, "{% for m in messages %}{{ m['content'] }} {% endfor %}"),
                       rows, [(reward, 1.0)], cfg, [2], seed=0)
    walls, waits, rewards = [], [], []
    try:
        for i in range(a.batches + 1):
            t = time.perf_counter()
            batch, metrics = loop.next_batch(trainer_version=0)
            if i:  # the first: warm-up
                walls.append(time.perf_counter() - t)
                waits.append(metrics["rollout/reward_wait_s"])
                rewards.append([s.reward for s in batch])
    finally:
        loop.scorer.close()
    return walls, waits, rewards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = build("tiny", "cpu", torch.float32, "unison")
    settings = [("costless", costless, 0), ("inline", realistic_math, 0)] + [
        (f"workers={n}", realistic_math, int(n)) for n in a.workers.split(",")]
    results, first_rewards = {}, None
    for name, reward, workers in settings:
        walls, waits, rewards = rollout(a, model, reward, workers)
        first_rewards = first_rewards or rewards
        assert rewards == first_rewards, f"{name} trained on other samples than {settings[0][0]}"
        results[name] = {"batch_s": walls, "reward_wait_s": waits, "batch_s_median": statistics.median(walls),
                         "reward_wait_s_median": statistics.median(waits)}
        print(f"{name:10s} {statistics.median(walls):6.3f} s a batch, reward wait {statistics.median(waits):6.3f} s "
              f"(median of {a.batches})", flush=True)
    out = {"device": "cpu", "cpu_count": os.cpu_count(), "torch_threads": 1,
           "workload": {k: getattr(a, k) for k in ("samples", "prompt", "new", "batches")}, "settings": results}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
