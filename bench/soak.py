"""Many GRPO steps through ``unison.train`` under torchrun: a data- or tensor-parallel run ends, with no hang.

    python bench/soak.py --make-checkpoint /tmp/soak --shape qwen3-1.7b                  # once
    python bench/soak.py /tmp/soak --steps 100 --json one.json                           # one GPU
    torchrun --nproc-per-node 2 bench/soak.py /tmp/soak --steps 100 --json dp2.json      # dp=2
    torchrun --nproc-per-node 2 bench/soak.py /tmp/soak --tp 2 --steps 100 --json tp2.json
    python bench/soak.py --make-checkpoint /tmp/soak --shape tiny --device cpu && \\
        torchrun --nproc-per-node 2 bench/soak.py /tmp/soak --tp 2 --steps 3 --new 8       # the harness, CPU

The run is the library's own training loop (``unison.train.loop.train``) with its defaults, on random weights of
a Qwen3 shape saved as a real checkpoint, random 64-token prompts and random rewards (``grpo_step.py``'s
workload, shorter completions so 100 steps take minutes). Rank 0 writes the per-step metrics' summary: steps
completed, wall time, median s/step and its split, and the engine-vs-trainer logprob difference (the
``mismatch/logprob_diff_mean`` metric, averaged over the run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
from engine import SHAPES
from grpo_step import GROUP, make_checkpoint, prompt_texts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", nargs="?")
    p.add_argument("--make-checkpoint", metavar="DIR", help="write random weights of --shape to DIR and exit")
    p.add_argument("--shape", default="qwen3-1.7b", choices=sorted(SHAPES), help="with --make-checkpoint")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (global); G=8 samples each")
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120.0, help="dist.timeout_s")
    p.add_argument("--eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--ready-every", type=int, default=None, help="dist.ready_every (engine steps)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other train setting")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.make_checkpoint:
        make_checkpoint(args.shape, args.make_checkpoint, torch.bfloat16, args.device)
        return
    from unison.config import load_config
    from unison.tasks import Task
    from unison.train.config import TrainConfig
    from unison.train.loop import train

    config = json.load(open(os.path.join(args.checkpoint, "config.json")))
    vocab = config["vocab_size"]
    shape = next((name for name, s in SHAPES.items() if all(config.get(k) == v for k, v in s.items())), "other")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    rng = random.Random(rank)
    task = Task("random-prompts", [{"prompt": t, "answer": ""} for t in prompt_texts(vocab, 64)],
                [(lambda prompts, completions, **_: [rng.random() for _ in completions], 1.0)])
    # (the final checkpoint holds the fp32 optimizer state: in memory where there is /dev/shm, it saves faster)
    out_dir = f"{'/dev/shm' if os.path.isdir('/dev/shm') else '/tmp'}/unison_soak_{world}_{args.tp}"
    n = args.prompts * GROUP
    cfg = load_config(TrainConfig, None, [
        f"--output_dir={out_dir}", f"--max_steps={args.steps}", "--log.report_to=[none]", "--overwrite=true",
        f"--model.name_or_path={args.checkpoint}", f"--model.device={args.device}", f"--dist.tp={args.tp}",
        f"--dist.timeout_s={args.timeout}", f"--rollout.group_size={GROUP}", f"--rollout.samples_per_step={n}",
        f"--rollout.max_concurrent_rollouts={n * args.tp // world}",  # each replica's engine: one step's worth
        f"--rollout.max_new_tokens={args.new}", "--optim.lr=1e-6", f"--engine.cuda_graphs={not args.eager}",
        *([f"--dist.ready_every={args.ready_every}"] if args.ready_every else []), *(f"--{kv}" for kv in args.set)])
    t0 = time.perf_counter()
    train(cfg, task)
    wall = time.perf_counter() - t0
    if rank != 0:
        return
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    later = rows[1:] or rows  # the first step compiles kernels and captures graphs

    def median(key):
        return statistics.median(r[key] for r in later)

    result = {"shape": shape, "world": world, "tp": args.tp, "replicas": world // args.tp,
              "samples_per_step": n, "new_tokens": args.new, "cuda_graphs": not args.eager,
              "ready_every": cfg.dist.ready_every,
              "steps_completed": len(rows), "steps": args.steps,
              "wall_s": wall, "s_per_step": median("time/step_s"), "rollout_s": median("time/rollout_s"),
              "train_s": median("time/train_s"), "samples_per_s": n / median("time/step_s"),
              "gen_tokens_per_s": median("rollout/tokens_per_s"), "engine_steps": median("rollout/engine_steps"),
              "kv_dropped_tokens": median("engine/kv_dropped_tokens") if "engine/kv_dropped_tokens" in rows[0] else 0,
              "logprob_diff_mean": statistics.mean(r["mismatch/logprob_diff_mean"] for r in rows),
              "logprob_diff_max": max(r["mismatch/logprob_diff_max"] for r in rows)}
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
