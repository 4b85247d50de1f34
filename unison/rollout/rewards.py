"""Scoring completions with plain reward callables, isolating their failures.

A reward function is ``fn(prompts, completions, **columns) -> list[float | None]``: ``columns`` holds the
dataset row's other fields as lists aligned with ``prompts`` (``answer=[...]``). A value is a real number: an
int, a float, a bool (an exact-match check may return ``c == a``: True scores 1.0), a numpy scalar or a 0-d
numpy array or torch tensor. ``None`` means "no reward for this one" (a closeness reward on a non-numeric
answer): it adds nothing. An exception, a NaN or inf, anything else in place of a number (a string such as
``"1.0"``, a list), a wrong-length result: each is a failure of that function, never a crash of a long run. A
completion with a failed reward (or none that applies) gets no reward and is not trained on.

Failures are counted per function (``RewardScorer.missing``; the step metrics ``reward/failed/<name>``) and
logged with the function's name: the first ``LOG_FIRST_FAILURES`` one by one, then at most one summary per
function every ``SUMMARY_EVERY_S`` seconds.

>>> def exact(prompts, completions, answer, **_):
...     return [float(c.strip() == a) for c, a in zip(completions, answer)]
>>> RewardScorer([(exact, 1.0)]).score(["1+1="], [" 2"], {"answer": ["2"]})
[(1.0, {'exact': 1.0})]
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float | None]]

LOG_FIRST_FAILURES = 3
"""Failures of one reward function logged one by one before they are only summarised."""
SUMMARY_EVERY_S = 60.0
"""At most one summary line per reward function this often: a verifier that always fails would otherwise log
every completion of a long run (thousands of lines a step, each of them alike)."""


class Scorer(Protocol):
    """What the rollout loop scores with: a ``RewardScorer``, or one that runs it elsewhere and shares the results
    (``unison.dist.tensor_parallel.BroadcastScorer``: rank 0 scores for its tensor-parallel ranks)."""

    names: list[str]
    """The reward functions' names, in order."""
    missing: Counter
    """Reward function name -> completions it failed to score so far, as far as this process knows."""

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list]
              ) -> list[tuple[float | None, dict[str, float]]]:
        """Per completion: the weighted reward (None where none can be given) and each function's value."""

    def missing_report(self) -> str | None:
        """Why completions got no reward so far, "" if every one got one (``RewardScorer.missing_report``); None
        where another process scores, whose report it is."""


@dataclass(frozen=True)
class _Failed:
    why: str  # "ZeroDivisionError: division by zero", "returned NaN"


class RewardScorer:
    def __init__(self, reward_fns: Sequence[tuple[RewardFn, float]]):
        if not reward_fns:
            raise ValueError("at least one reward function is needed")
        self.reward_fns = list(reward_fns)
        self.names = [getattr(fn, "__name__", type(fn).__name__) for fn, _ in self.reward_fns]
        self.missing = Counter()  # reward function name -> completions it failed to score
        self.last_failure: dict[str, str] = {}  # reward function name -> why it failed last
        self.scored = 0  # completions scored so far
        self.not_applied = 0  # completions no reward function applied to (each returned None)
        self._unlogged = Counter()  # name -> failures since its last log line
        self._logged_at: dict[str, float] = {}  # name -> time.monotonic() of its last log line

    def score(self, prompts: list[str], completions: list[str], columns: dict[str, list]
              ) -> list[tuple[float | None, dict[str, float]]]:
        """Per completion: the weighted reward of the functions that apply (None where one failed or none
        applies) and each applying function's value."""
        n = len(completions)
        self.scored += n
        totals: list[float | None] = [0.0] * n
        parts: list[dict[str, float]] = [{} for _ in range(n)]
        for name, (fn, weight) in zip(self.names, self.reward_fns, strict=True):
            for i, v in enumerate(self._call(fn, prompts, completions, columns)):
                if v is None:  # does not apply to this completion
                    continue
                if isinstance(v, _Failed):
                    self._failed(name, v.why)
                    totals[i] = None
                    continue
                if totals[i] is not None:
                    total = totals[i] + weight * v
                    if not math.isfinite(total):  # an inf reward would make its group's advantages NaN
                        self._failed(name, f"returned {v!r}, which at weight {weight} takes the total reward past "
                                           "the float range")
                        totals[i] = None
                        continue
                    totals[i] = total
                parts[i][name] = v
        self.not_applied += sum(1 for t, p in zip(totals, parts, strict=True) if t is not None and not p)
        return [(t if p else None, p) for t, p in zip(totals, parts, strict=True)]

    def missing_report(self) -> str:
        """Why completions got no reward so far: each reward function that failed, on how many completions and
        why it failed last; how many none applied to. "" when every completion got a reward."""
        why = [f"reward function {name} failed on {n} of {self.scored} completions (last: {self.last_failure[name]})"
               for name, n in self.missing.items() if n]
        if self.not_applied:
            why.append(f"no reward function applied to {self.not_applied} of {self.scored} completions (each "
                       "returned None)")
        return "; ".join(why)

    def _call(self, fn: RewardFn, prompts, completions, columns) -> list[float | None | _Failed]:
        try:
            values = list(fn(prompts, completions, **columns))
            if len(values) != len(completions):
                raise ValueError(f"returned {len(values)} values for {len(completions)} completions")
        except Exception as e:  # a user's reward function must not end the run
            if len(completions) > 1:  # isolate the completions it fails on: score them one at a time
                return [self._call(fn, prompts[i:i + 1], completions[i:i + 1],
                                   {k: v[i:i + 1] for k, v in columns.items()})[0] for i in range(len(completions))]
            return [_Failed(f"{type(e).__name__}: {e}"[:300])]
        return [None if v is None else _as_reward(v) for v in values]

    def _failed(self, name: str, why: str) -> None:
        self.missing[name] += 1
        self.last_failure[name] = why
        now = time.monotonic()
        if self.missing[name] <= LOG_FIRST_FAILURES:
            later = f" (from now on: a summary every {SUMMARY_EVERY_S:.0f} s at most)" \
                if self.missing[name] == LOG_FIRST_FAILURES else ""
            log.warning("reward function %s failed: %s%s", name, why, later)
            self._logged_at[name] = now
            return
        self._unlogged[name] += 1
        if now - self._logged_at[name] >= SUMMARY_EVERY_S:
            log.warning("reward function %s failed on %d more completions in %.0f s (%d of %d so far; last: %s)",
                        name, self._unlogged[name], now - self._logged_at[name], self.missing[name], self.scored,
                        why)
            self._unlogged[name] = 0
            self._logged_at[name] = now


def _as_reward(value) -> float | _Failed:
    """``value`` as a finite float, or why it is none."""
    try:
        if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
            value = value.item()  # a 0-d numpy array or torch tensor, a numpy bool
        if not isinstance(value, numbers.Real):  # float("1.0") would parse a string: a bug, not a reward
            return _Failed(f"returned {type(value).__name__} {value!r:.60}, not a number")
        value = float(value)
    except Exception as e:  # an int past the float range; a value object that fails when converted
        return _Failed(f"returned {type(value).__name__} with no float value ({type(e).__name__}: {e})"[:300])
    if math.isnan(value):
        return _Failed("returned NaN")
    if math.isinf(value):
        return _Failed(f"returned {value}")
    return value
