"""Scoring completions with plain reward callables, isolating their failures.

A reward function is ``fn(prompts, completions, **columns) -> list[float | None]``: ``columns`` holds the
dataset row's other fields as lists aligned with ``prompts`` (``answer=[...]``). ``None`` means "no reward for
this one" (a closeness reward on a non-numeric answer): it adds nothing. An exception, a NaN or inf, a
wrong-length result: each is logged and counted as a missing reward, never a crash of a long run; a completion
with a missing reward (or none that applies) gets no reward and is not trained on.

>>> def exact(prompts, completions, answer, **_):
...     return [float(c.strip() == a) for c, a in zip(completions, answer)]
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence

log = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]


class RewardScorer:
    def __init__(self, reward_fns: Sequence[tuple[RewardFn, float]]):
        if not reward_fns:
            raise ValueError("at least one reward function is needed")
        self.reward_fns = list(reward_fns)
        self.missing = Counter()  # reward function name -> completions it failed to score

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list]
              ) -> list[tuple[float | None, dict[str, float]]]:
        """Per completion: the weighted reward of the functions that apply (None where one failed or none
        applies) and each applying function's value."""
        n = len(completions)
        totals: list[float | None] = [0.0] * n
        parts: list[dict[str, float]] = [{} for _ in range(n)]
        for fn, weight in self.reward_fns:
            name = getattr(fn, "__name__", type(fn).__name__)
            values = self._call(fn, name, prompts, completions, columns)
            for i, v in enumerate(values):
                if v is None:  # does not apply to this completion
                    continue
                if v is _FAILED or not math.isfinite(v):
                    self.missing[name] += 1
                    totals[i] = None
                    continue
                parts[i][name] = v
                if totals[i] is not None:
                    totals[i] += weight * v
        return [(t if p else None, p) for t, p in zip(totals, parts, strict=True)]

    def _call(self, fn: RewardFn, name: str, prompts, completions, columns) -> list:
        try:
            values = list(fn(prompts, completions, **columns))
            if len(values) != len(completions):
                raise ValueError(f"returned {len(values)} values for {len(completions)} completions")
            return [None if v is None else float(v) for v in values]
        except Exception as e:  # a user's reward function must not end the run
            if len(completions) > 1:  # isolate the completions it fails on: score them one at a time
                return [self._call(fn, name, prompts[i:i + 1], completions[i:i + 1],
                                   {k: v[i:i + 1] for k, v in columns.items()})[0] for i in range(len(completions))]
            log.warning("reward function %s failed: %s: %s", name, type(e).__name__, e)
            return [_FAILED]


_FAILED = float("nan")  # what a failed call scores: counted as missing, like a NaN
