"""What scoring a GRPO step's completions with math-verify costs the host (``unison.tasks.rewards.MathReward``),
which the single-turn rollout loop does between engine steps (``RolloutLoop._land``):

    python bench/reward_cost.py --json bench/results/cpu/reward_cost.json

64 completions a pass (a step's 8 prompts x G = 8), ~1,500 characters of working each, ending in one of four
kinds of answer: a boxed integer, a boxed fraction, a boxed expression with a radical and pi, no boxed answer
(math-verify then parses the whole completion). Golds are integers, mostly wrong (as early in training). The first
pass includes math-verify's and SymPy's first-use costs; the later ones are what a long run pays a step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import zlib

from unison.tasks.rewards import MathReward

WORKING = "Let me think step by step. We have x = 3 and y = 4, so x^2 + y^2 = 25. " * 20
KINDS = {
    "boxed integer": lambda a: f"The answer is \\boxed{{{a}}}.",
    "boxed fraction": lambda a: f"So the result is \\boxed{{\\frac{{{a}}}{{7}}}}.",
    "boxed radical": lambda a: f"Thus \\boxed{{{a}\\sqrt{{2}} + \\pi}}",
    "no boxed answer": lambda a: "I am not sure. $x^2 + 2x + 1 = (x+1)^2$",
}


def completions(n: int, seed: int) -> tuple[list[str], list[str], list[str]]:
    rng = random.Random(seed)
    kinds = [list(KINDS)[i % len(KINDS)] for i in range(n)]
    texts = [WORKING + KINDS[k](rng.randint(1, 1000)) for k in kinds]
    return texts, [str(rng.randint(1, 1000)) for _ in range(n)], kinds


_RNG = random.Random(1000)
# Realistic completions standing for a random model's word salad, each with its gold answer: a boxed integer's own
# answer half the time (a right answer: rewards with spread), else another.
STAND_INS = [(WORKING + KINDS[kind](a), str(a if i % 8 < 4 else a + 1))
             for i, (kind, a) in enumerate((list(KINDS)[i % len(KINDS)], _RNG.randint(1, 1000)) for i in range(256))]
_MATH = MathReward()


_KNOWN: list[float] = []  # realistic_math's value of each stand-in, for costless


def realistic_math(prompts, completions, **_):
    """math-verify on one of ``STAND_INS`` for each completion (picked by its hash), against its gold: what scoring
    a real model's completion costs, where the model is a random one (``bench/reward_overlap.py``)."""
    keys = [zlib.crc32(c.encode()) for c in completions]
    picked = [STAND_INS[k % len(STAND_INS)] for k in keys]
    values = _MATH(prompts, [t for t, _ in picked], answer=[g for _, g in picked])
    return [v + _spread(k) for v, k in zip(values, keys, strict=True)]


def _spread(key: int) -> float:
    """Under 1e-3 from the completion's hash: every group has rewards with spread, so no group is dropped and every
    setting generates the same samples a step (the dropped groups' extra rounds would swamp what scoring costs)."""
    return 1e-3 * (key % 997) / 997


def costless(prompts, completions, **_):
    """``realistic_math``'s values at no cost (each stand-in scored once, at the first call): the same batches, the
    floor of bench/reward_overlap.py."""
    if not _KNOWN:
        _KNOWN.extend(_MATH([""] * len(STAND_INS), [t for t, _ in STAND_INS], answer=[g for _, g in STAND_INS]))
    keys = [zlib.crc32(c.encode()) for c in completions]
    return [_KNOWN[k % len(STAND_INS)] + _spread(k) for k in keys]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--completions", type=int, default=64)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    reward = MathReward()
    passes, per_kind = [], {k: [] for k in KINDS}
    for seed in range(args.passes):
        texts, golds, kinds = completions(args.completions, seed)
        t0 = time.perf_counter()
        for text, gold, kind in zip(texts, golds, kinds, strict=True):
            t = time.perf_counter()
            reward([""], [text], answer=[gold])
            if seed:
                per_kind[kind].append(time.perf_counter() - t)
        passes.append(time.perf_counter() - t0)
        print(f"pass {seed}: {args.completions} completions in {passes[-1]:.3f} s")
    result = {"completions_per_pass": args.completions, "pass_s": passes,
              "later_passes_median_s": statistics.median(passes[1:]),
              "ms_per_completion_by_kind": {k: 1e3 * statistics.median(v) for k, v in per_kind.items()}}
    for kind, ms in result["ms_per_completion_by_kind"].items():
        print(f"{kind:16s} {ms:7.2f} ms a completion (median, passes after the first)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
