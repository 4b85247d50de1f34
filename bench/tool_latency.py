"""Multi-turn rollouts whose environment takes time to answer: tools in the background against every engine step
waiting for its tools (``EpisodeConfig.tools_in_background``), in one run.

    python bench/tool_latency.py --latency 0,0.25 --json bench/results/cpu/tool_latency.json   # CPU, ~5 min

The built-in ``sum_feedback`` task (feedback and retries, ``episode.max_turns`` answers) on the default model
(SmolLM2-135M-Instruct, from its GGUF; or ``--model``), with its environment's ``respond`` delayed by ``--latency``
seconds (a stand-in for a sandbox, a judge model or a web call). Each configuration rolls out the same
``--batches`` batches from the same seed after a warm-up batch; reported: wall seconds, engine steps, the seconds the
loop waited on the environment with nothing to decode (``rollout/tool_wait_s``), model tokens per second, and the
episodes' turns. A seeded episode's tokens do not depend on which step a reply lands on, so both modes roll out the
same episodes where the engine's numerics do not change with the batch (on the CPU they may, slightly).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from unison.engine import Engine, EngineConfig
from unison.episodes import EpisodeConfig, MultiTurnRolloutLoop
from unison.models import DEFAULT_MODEL, load_policy, stop_token_ids
from unison.rollout.loop import RolloutConfig
from unison.tasks import DataConfig, load_task
from unison.tasks.multiturn import SumFeedback


def slow(latency: float) -> type:
    class SlowFeedback(SumFeedback):
        def respond(self, text: str) -> str | None:
            time.sleep(latency)
            return super().respond(text)

    return SlowFeedback


def rollout(model, tokenizer, task, background: bool, latency: float, a) -> dict:
    engine = Engine(model, EngineConfig(num_blocks=a.group * a.groups * (a.max_tokens // 16 + 2), block_size=16,
                                        max_model_len=a.max_tokens, seed=0))
    n = a.group * a.groups
    loop = MultiTurnRolloutLoop(
        engine, tokenizer, task.rows, task.reward_fns,
        RolloutConfig(group_size=a.group, samples_per_step=n, max_concurrent_rollouts=n, max_new_tokens=a.new),
        stop_token_ids(tokenizer, model), seed=0, system_prompt=task.system_prompt, max_sample_tokens=a.max_tokens,
        episode_cfg=EpisodeConfig(max_turns=a.turns, tools_in_background=background, tool_timeout_s=30),
        environment_factory=slow(latency))
    loop.next_batch(trainer_version=0)  # warm-up
    steps0 = engine.stats()["steps"]
    t0, waited, tokens, turns = time.perf_counter(), 0.0, 0, []
    for _ in range(a.batches):
        batch, m = loop.next_batch(trainer_version=0)
        waited += m["rollout/tool_wait_s"]
        tokens += sum(sum(s.completion_mask) for s in batch)
        turns.append(m["episode/turns_mean"])
    wall = time.perf_counter() - t0
    return {"tools_in_background": background, "latency_s": latency, "wall_s": round(wall, 3),
            "engine_steps": engine.stats()["steps"] - steps0, "tool_wait_s": round(waited, 3),
            "model_tokens": tokens, "model_tokens_per_s": round(tokens / wall, 1),
            "turns_mean": round(sum(turns) / len(turns), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--latency", default="0,0.25", help="seconds each respond takes, comma-separated")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2, help="groups in flight (and per batch)")
    ap.add_argument("--turns", type=int, default=3, help="episode.max_turns")
    ap.add_argument("--new", type=int, default=96, help="max_new_tokens of a turn")
    ap.add_argument("--max-tokens", type=int, default=1024, help="tokens of an episode")
    ap.add_argument("--batches", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_policy(a.model, device=device)
    task = load_task(DataConfig(source="sum_feedback", size=64))
    results = []
    for latency in (float(x) for x in a.latency.split(",")):
        for background in (False, True):
            r = rollout(model, tokenizer, task, background, latency, a)
            print(json.dumps(r), flush=True)
            results.append(r)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.machine()}, "
           f"{torch.get_num_threads()} threads)", "model": a.model,
           "workload": {k: getattr(a, k) for k in ("group", "groups", "turns", "new", "max_tokens", "batches")},
           "results": results}
    print(f"{'background':>10}  {'latency s':>9}  {'wall s':>7}  {'steps':>6}  {'tool wait s':>11}  {'tok/s':>7}")
    for r in results:
        print(f"{r['tools_in_background']!s:>10}  {r['latency_s']:9.2f}  {r['wall_s']:7.2f}  {r['engine_steps']:6d}  "
              f"{r['tool_wait_s']:11.2f}  {r['model_tokens_per_s']:7.1f}")
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
