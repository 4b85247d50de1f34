"""A multi-turn rollout through the episode loop on the engine with overlapped decode steps: how many decode steps
were launched ahead of the last one's read-back (``engine.stats()["ahead_steps"]``), and the wall time.

    python bench/loop_overlap.py --json bench/results/cpu/loop_overlap.json           # CPU: Triton's interpreter
    python bench/loop_overlap.py --shape qwen3-0.6b --episodes 64 --json loop_overlap.json   # GPU

Random weights of a ``bench/engine.py`` shape, a word-level tokenizer (``grpo_step.word_tokenizer``) whose chat
template renders each message's words, a turn that ends on any of ``--stop-words`` words (so turns end at
different steps), and an environment that answers every turn with ``--reply`` words until the episode's last turn.
The overlapped decode only helps where the loop leaves a step in flight between ``engine.step()`` calls: any engine
call that drains it (``release``, ``extend``, ``abort``) makes the next step wait for the device.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import time

import torch

if not torch.cuda.is_available():  # the Triton kernels in the interpreter (read when the kernels are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine import SHAPES, build  # noqa: E402  (bench/engine.py)
from grpo_step import word_tokenizer  # noqa: E402

from unison.engine import Engine, EngineConfig  # noqa: E402
from unison.episodes import EpisodeConfig, MultiTurnRolloutLoop  # noqa: E402
from unison.rollout.loop import RolloutConfig  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def answer_every_turn(reply: str):
    class Answers:
        def reset(self, **_) -> None:
            pass

        def respond(self, text: str) -> str:
            return reply  # the loop ends the episode at episode.max_turns

    return Answers


def rewards(prompts, completions, **_) -> list[float]:
    return [float(len(c)) for c in completions]  # a spread within every group


def workload_args(ap: argparse.ArgumentParser) -> None:
    """The episodes' options (shared with ``bench/tool_latency_tp.py``)."""
    ap.add_argument("--episodes", type=int, default=16, help="in flight, and per batch")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new", type=int, default=64, help="max_new_tokens of a turn")
    ap.add_argument("--stop-words", type=int, default=48, help="one in this many words ends a turn")
    ap.add_argument("--reply", type=int, default=16, help="words of the environment's reply")
    ap.add_argument("--batches", type=int, default=2)


def episode_loop(a, model, engine_config: dict, episode_config: dict, environment=answer_every_turn,
                 **loop_kwargs) -> MultiTurnRolloutLoop:
    """The loop of ``a``'s workload on ``model`` (an engine of ``engine_config``'s extra fields), its environment
    made by ``environment(reply)``."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = [{"prompt": " ".join(f"w{i}" for i in torch.randint(3, vocab, (32,), generator=g).tolist())}
            for _ in range(64)]
    reply = " ".join(f"w{i}" for i in torch.randint(3, vocab, (a.reply,), generator=g).tolist())
    max_tokens = 32 + a.turns * (a.new + a.reply + 2)
    engine = Engine(model, EngineConfig(num_blocks=a.episodes * (max_tokens // 16 + 2), block_size=16,
                                        max_model_len=max_tokens, seed=0, **engine_config))
    return MultiTurnRolloutLoop(
        engine, word_tokenizer(vocab, TEMPLATE), rows, [(rewards, 1.0)],
        RolloutConfig(group_size=a.group, samples_per_step=a.episodes, max_concurrent_rollouts=a.episodes,
                      max_new_tokens=a.new), list(range(3, vocab, a.stop_words)), seed=0, max_sample_tokens=max_tokens,
        episode_cfg=EpisodeConfig(max_turns=a.turns, **episode_config), environment_factory=environment(reply),
        **loop_kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    workload_args(ap)
    ap.add_argument("--blocking", action="store_true", help="episode.tools_in_background=false")
    ap.add_argument("--json", default="")
    ap.add_argument("--cprofile", default="", help="write cProfile's top functions of the eager steps here (text)")
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    model = build(a.shape, a.device, dtype, "unison")
    loop = episode_loop(a, model, {"attention": "triton"},
                        {"tools_in_background": False} if a.blocking else {})
    engine = loop.engine
    loop.next_batch(trainer_version=0)  # warm-up: kernels compiled, graphs captured
    eager = {"steps": 0, "s": 0.0}  # the engine steps that ran outside the decode graphs (a prefill in them)
    step = engine.step

    profiled: list[pstats.Stats] = []

    def timed_step():
        before_step, t = dict(engine._counters), time.perf_counter()
        profile = cProfile.Profile() if a.cprofile else None
        out = profile.runcall(step) if profile else step()
        after = engine._counters
        if after["graph_steps"] == before_step["graph_steps"] and after["steps"] > before_step["steps"]:
            eager["steps"], eager["s"] = eager["steps"] + 1, eager["s"] + time.perf_counter() - t
            if profile:
                profiled.append(pstats.Stats(profile))
        return out
    engine.step = timed_step
    spent = {"_fill": 0.0, "_land": 0.0}  # the loop's own work between engine steps

    def timed(name):
        fn = getattr(loop, name)

        def run(*args):
            t = time.perf_counter()
            out = fn(*args)
            spent[name] += time.perf_counter() - t
            return out
        return run
    for name in spent:
        setattr(loop, name, timed(name))
    before = engine.stats()
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    sync()
    t0, metrics = time.perf_counter(), []
    for _ in range(a.batches):
        metrics.append(loop.next_batch(trainer_version=0)[1])
    sync()
    wall = time.perf_counter() - t0
    s = engine.stats()
    steps = s["steps"] - before["steps"]
    out = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "workload": {k: getattr(a, k) for k in ("shape", "episodes", "group", "turns", "new", "stop_words",
                                                   "reply", "batches", "blocking")},
           "wall_s": round(wall, 3), "steps": steps, "graph_steps": s["graph_steps"] - before["graph_steps"],
           "ahead_steps": s["ahead_steps"] - before["ahead_steps"],
           # the engine's step() calls (launches, bookkeeping, and waiting for the device's tokens), and the rest
           "engine_step_s": round(s["step_s"] - before["step_s"], 3),
           "engine_wait_s": round(s["wait_s"] - before["wait_s"], 3),
           "outside_steps_s": round(wall - (s["step_s"] - before["step_s"]), 3),
           "tokens_computed": s["tokens_computed"] - before["tokens_computed"],
           "eager_steps": eager["steps"], "eager_steps_s": round(eager["s"], 3),
           "loop_fill_s": round(spent["_fill"], 3), "loop_land_s": round(spent["_land"], 3),
           "turns_mean": sum(m["episode/turns_mean"] for m in metrics) / len(metrics),
           "template_mismatch": metrics[-1]["rollout/template_mismatch"]}
    print(json.dumps(out, indent=2))
    if profiled:
        with open(a.cprofile, "w") as f:
            stats = profiled[0]
            for more in profiled[1:]:
                stats.add(more)
            stats.stream = f
            print(f"{len(profiled)} eager steps, {eager['s']:.3f} s (under cProfile)", file=f)
            stats.sort_stats("tottime").print_stats(45)
            stats.sort_stats("cumulative").print_stats(45)
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
