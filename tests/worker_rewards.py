"""Reward functions that tests/test_reward_workers.py sends to reward worker processes: a light module (no torch),
which a worker imports to unpickle them."""

from __future__ import annotations

import os
import sys
import time

IN_WORKER = bool(sys.argv) and sys.argv[0].endswith("reward_workers.py")
if IN_WORKER and os.environ.get("WORKER_REWARDS_REFUSE"):
    raise ImportError("worker_rewards refuses to load in a reward worker (WORKER_REWARDS_REFUSE)")
if IN_WORKER:  # a slow import (a verifier that loads a model, SymPy's first use)
    time.sleep(float(os.environ.get("WORKER_REWARDS_LOAD_S", "0")))


def count_w7(prompts, completions, **_):
    """As tests/test_rollout.py's: varies across samples of a random model."""
    return [c.split().count("w7") + 0.01 * len(c.split()) for c in completions]


def pid(prompts, completions, **_):
    """The process that scored each completion."""
    return [float(os.getpid())] * len(completions)


def length(prompts, completions, answer, **_):
    return [len(c) + int(a) for c, a in zip(completions, answer, strict=True)]


def exits_on_boom(prompts, completions, **_):
    """Takes its process down (a verifier's segfault) when a completion says "boom"."""
    if any("boom" in c for c in completions):
        os._exit(3)
    return [1.0] * len(completions)


def hangs_on_slow(prompts, completions, **_):
    if any("slow" in c for c in completions):
        time.sleep(60)
    return [1.0] * len(completions)


def takes(prompts, completions, **_):
    """Takes as many seconds as the first completion says."""
    time.sleep(float(completions[0]))
    return [1.0] * len(completions)


def found(prompts, completions, **_):
    """1 where the last turn says it found the number; its length breaks ties."""
    return [float("Found it" in c) + 0.01 * len(c) for c in completions]


def found_slowly(prompts, completions, **_):
    """``found``, a quarter second a call (a verifier's sandbox)."""
    time.sleep(0.25)
    return found(prompts, completions)
