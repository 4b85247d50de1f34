"""Starting success of the default policy on the built-in multi-turn task ``sum_feedback``: episodes rolled out by
the trainer's own multi-turn loop and engine (no training), at the trainer's default sampling (T=1.0, 64 new tokens
a turn, groups of 8).

Reported, over the first ``--prompts`` x ``--group`` episodes: the solve rate at the first attempt and within
``--turns`` attempts, the attempt that solved, the share of groups whose solves differ, answers per episode; and per
batch the loop formed, ``reward/mean`` and turns per episode, with the counts of groups with and without a reward
spread (GRPO learns only from the former; the loop stops, recorded as ``no_batch``, when none has).
``--sentence`` moves the task's retry sentence (``TRY_AGAIN``) after the question, or leaves it out, to compare
prompts. Prints JSON and writes it to ``--json``.

    python bench/sum_feedback_probe.py --prompts 4 --json bench/results/cpu/sum_feedback_probe.json
    python bench/sum_feedback_probe.py --prompts 32 --sentence after --json bench/results/h200/sum_feedback_after.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

from unison.engine import Engine, EngineConfig
from unison.episodes import EpisodeConfig, MultiTurnRolloutLoop
from unison.models import DEFAULT_MODEL, load_policy, stop_token_ids
from unison.rollout.loop import RolloutConfig
from unison.tasks import DataConfig, load_task
from unison.tasks.multiturn import TRY_AGAIN, SumFeedback


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sentence", choices=["before", "after", "none"], default="before",
                   help="where the prompt says that feedback and retries follow (the task's own: before)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_policy(args.model, device=args.device)
    task = load_task(DataConfig(source="sum_feedback", size=args.prompts, seed=args.seed))
    question = [row["prompt"].removeprefix(f"{TRY_AGAIN}\n") for row in task.rows]
    prompts = {"before": [row["prompt"] for row in task.rows], "none": question,
               "after": [f"{q} {TRY_AGAIN}" for q in question]}[args.sentence]
    rows = [{**row, "prompt": prompt} for row, prompt in zip(task.rows, prompts, strict=True)]
    n = args.prompts * args.group
    engine = Engine(model, EngineConfig(num_blocks=n * 40, block_size=16, seed=args.seed, cuda_graphs=False),
                    tokenizer=tokenizer)
    envs: list[SumFeedback] = []

    def factory() -> SumFeedback:
        envs.append(SumFeedback())
        return envs[-1]

    rollout = RolloutConfig(group_size=args.group, samples_per_step=args.group, max_concurrent_rollouts=n,
                            max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    loop = MultiTurnRolloutLoop(engine, tokenizer, rows, task.reward_fns, rollout,
                                stop_token_ids(tokenizer, model), seed=args.seed, max_sample_tokens=2048,
                                episode_cfg=EpisodeConfig(max_turns=args.turns), environment_factory=factory)
    start = time.perf_counter()
    metrics = []
    no_batch = ""
    while True:
        try:
            _, m = loop.next_batch(trainer_version=0)
        except RuntimeError as e:  # every group without a reward spread: a finding, not a crash
            no_batch = str(e)
            break
        metrics.append(m)
        done = {id(e) for e in envs[:n]}  # the first groups' episodes (all started at once; the loop starts more)
        if len(done) == n and not any(id(ep.environment) in done for ep in loop.episodes.values()):
            break
    seconds = time.perf_counter() - start
    done = envs[:n]
    groups = [done[i:i + args.group] for i in range(0, n, args.group)]
    result = {
        "model": args.model, "prompts": args.prompts, "group": args.group, "max_turns": args.turns,
        "device": args.device, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
        "sentence": args.sentence,
        "seconds": round(seconds, 1), "first_answers": sum(e.attempts > 0 for e in done),
        "solved_first_try": sum(e.solved_at == 1 for e in done) / n,
        "solved": sum(e.solved for e in done) / n,
        "solved_at": dict(Counter(e.solved_at for e in done if e.solved)),
        "groups_with_solve_spread": sum(len({e.solved for e in g}) > 1 for g in groups) / len(groups),
        "attempts_mean": sum(e.attempts for e in done) / n,
        "reward_mean_of_steps": [m["reward/mean"] for m in metrics],
        "turns_mean_of_steps": [m["episode/turns_mean"] for m in metrics],
        "zero_std_groups": loop.counts["zero_std_groups"], "groups": loop.counts["groups"],
        "dropped_episodes": loop.counts["dropped_episodes"], "no_batch": no_batch,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
