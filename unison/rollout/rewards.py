"""Scoring completions with plain reward callables, isolating their failures.

A reward function is ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``, TRL's
signature: ``columns`` holds the dataset row's other fields as lists aligned with ``prompts`` (``answer=[...]``);
``completion_ids`` (the completions' token ids) is passed to a function that names it or takes ``**kwargs``. Where a
prompt is conversational (a list of ``{"role", "content"}`` messages) its completion is passed as TRL passes it,
``[{"role": "assistant", "content": text}]``. An ``async def`` function is awaited, all of them concurrently. A
value is a real number: an
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

import asyncio
import concurrent.futures
import inspect
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


class Scoring(Protocol):
    """A submitted call's results: ready when ``done()``; ``result()`` waits for them."""

    def done(self) -> bool: ...

    def result(self) -> list[tuple[float | None, dict[str, float]]]: ...


class Scored:
    """A ``Scoring`` scored when it was submitted."""

    def __init__(self, results: list[tuple[float | None, dict[str, float]]]):
        self.results = results

    def done(self) -> bool:
        return True

    def result(self) -> list[tuple[float | None, dict[str, float]]]:
        return self.results


class Scorer(Protocol):
    """What the rollout loop scores with: a ``RewardScorer``, or one that runs it elsewhere and shares the results
    (``unison.dist.tensor_parallel.BroadcastScorer``: rank 0 scores for its tensor-parallel ranks)."""

    names: list[str]
    """The reward functions' names, in order."""
    missing: Counter
    """Reward function name -> completions it failed to score so far, as far as this process knows."""

    def score(self, prompts: list, completions: list[str], columns: dict[str, list],
              completion_ids: list[list[int]] | None = None) -> list[tuple[float | None, dict[str, float]]]:
        """Per completion: the weighted reward (None where none can be given) and each function's value."""

    def submit(self, prompts: list, completions: list[str], columns: dict[str, list],
               completion_ids: list[list[int]] | None = None) -> Scoring:
        """``score``'s results, possibly later (reward workers): the rollout loop steps the engine meanwhile."""

    def missing_report(self) -> str | None:
        """Why completions got no reward so far, "" if every one got one (``RewardScorer.missing_report``); None
        where another process scores, whose report it is."""

    def close(self) -> None:
        """Stops what it runs beside the loop (reward workers); scoring ends with it."""


class WrappedScorer:
    """A scorer around another (rank 0's scorer broadcast, a recording one): the names, failure counts and report
    are the inner scorer's; subclasses change ``score``."""

    def __init__(self, inner: Scorer):
        self.inner = inner

    @property
    def names(self) -> list[str]:
        return self.inner.names

    @property
    def missing(self):
        return self.inner.missing

    def missing_report(self) -> str | None:
        return self.inner.missing_report()

    def score(self, prompts, completions, columns, completion_ids=None):
        return self.inner.score(prompts, completions, columns, completion_ids)

    def submit(self, prompts, completions, columns, completion_ids=None) -> Scoring:
        """Scored now through ``score`` (a subclass's; a broadcast is a collective every rank takes at once)."""
        return Scored(self.score(prompts, completions, columns, completion_ids))

    def close(self) -> None:
        self.inner.close()


@dataclass(frozen=True)
class _Failed:
    why: str  # "ZeroDivisionError: division by zero", "returned NaN"


class RewardScorer:
    """Scores with ``reward_fns``: here, or with ``workers`` > 0 in that many worker processes
    (``unison.rollout.reward_workers``; a worker's batch that takes longer than ``timeout_s`` fails)."""

    def __init__(self, reward_fns: Sequence[tuple[RewardFn, float]], workers: int = 0, timeout_s: float = 300.0,
                 asked: bool = True):
        """``asked``: the workers were asked for (a warning, not a note in the log, where they cannot be had)."""
        if not reward_fns:
            raise ValueError("at least one reward function is needed")
        self.reward_fns = list(reward_fns)
        self.names = _unique([getattr(fn, "__name__", type(fn).__name__) for fn, _ in self.reward_fns])
        self.workers = _workers([fn for fn, _ in self.reward_fns], workers, timeout_s, self._all_values, asked) \
            if workers else None
        self.missing = Counter()  # reward function name -> completions it failed to score
        self.last_failure: dict[str, str] = {}  # reward function name -> why it failed last
        self.scored = 0  # completions scored so far
        self.not_applied = 0  # completions no reward function applied to (each returned None)
        self._unlogged = Counter()  # name -> failures since its last log line
        self._logged_at: dict[str, float] = {}  # name -> time.monotonic() of its last log line

    def score(self, prompts: list, completions: list[str], columns: dict[str, list],
              completion_ids: list[list[int]] | None = None) -> list[tuple[float | None, dict[str, float]]]:
        """Per completion: the weighted reward of the functions that apply (None where one failed or none
        applies) and each applying function's value. ``prompts[i]`` is a string or a list of messages;
        ``completion_ids[i]`` the token ids of ``completions[i]`` (None: not known, passed as None)."""
        return self.submit(prompts, completions, columns, completion_ids).result()

    def submit(self, prompts: list, completions: list[str], columns: dict[str, list],
               completion_ids: list[list[int]] | None = None) -> Scoring:
        """``score``'s results: scored here now, or by the workers (``done()`` once they are back)."""
        n = len(completions)
        call = _Call(list(prompts), _as_trl_completions(prompts, completions),
                     list(completion_ids) if completion_ids is not None else [None] * n, columns)
        if self.workers is not None and n:
            return self.workers.submit(call, self._tally)
        return Scored(self._tally(self._all_values(call)))

    def apart(self) -> RewardScorer:
        """A scorer of the same functions on the same workers that counts its own failures (the evaluation's, kept
        apart from the training's). Closing this scorer stops the workers."""
        other = RewardScorer(self.reward_fns)
        other.workers = self.workers
        return other

    def close(self) -> None:
        """Stops the workers (if any; they also stop with this object, or when the process exits)."""
        if self.workers is not None:
            self.workers.close()

    def _tally(self, all_values: list[list[float | None | _Failed]]) -> list[tuple[float | None, dict[str, float]]]:
        """The weighted totals of each function's values; failures counted and logged."""
        n = len(all_values[0])
        self.scored += n
        totals: list[float | None] = [0.0] * n
        parts: list[dict[str, float]] = [{} for _ in range(n)]
        for name, (_, weight), values in zip(self.names, self.reward_fns, all_values, strict=True):
            for i, v in enumerate(values):
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

    def _all_values(self, call: _Call) -> list[list[float | None | _Failed]]:
        """Each function's values, in order: the plain functions one after another, the async ones awaited together
        (a verifier that waits on a sandbox or an API should not wait for the others)."""
        out: list = [None] * len(self.reward_fns)
        waiting = []
        for k, (fn, _) in enumerate(self.reward_fns):
            if _is_async(fn):
                waiting.append(k)
            else:
                out[k] = self._call(fn, call)
        if waiting:
            async def gather():
                return await asyncio.gather(*(self._acall(self.reward_fns[k][0], call) for k in waiting))
            for k, values in zip(waiting, _run_coroutine(gather()), strict=True):
                out[k] = values
        return out

    def _call(self, fn: RewardFn, call: _Call) -> list[float | None | _Failed]:
        try:
            values = call.invoke(fn)
            if inspect.isawaitable(values):  # a callable object whose __call__ is async
                values = _run_coroutine(_await(values))
            return _checked(values, len(call.completions))
        except Exception as e:  # a user's reward function must not end the run
            if len(call.completions) > 1:  # isolate the completions it fails on: score them one at a time
                return [self._call(fn, one)[0] for one in call.split()]
            return [_Failed(f"{type(e).__name__}: {e}"[:300])]

    async def _acall(self, fn: RewardFn, call: _Call) -> list[float | None | _Failed]:
        try:
            return _checked(await call.invoke(fn), len(call.completions))
        except Exception as e:  # as in _call: isolated, concurrently
            if len(call.completions) > 1:
                return [v[0] for v in await asyncio.gather(*(self._acall(fn, one) for one in call.split()))]
            return [_Failed(f"{type(e).__name__}: {e}"[:300])]

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


def _workers(fns: list, n: int, timeout_s: float, inline, asked: bool):
    """The worker processes for ``fns``, or None (inline scoring, the log saying why) where a function cannot
    travel to them."""
    from .reward_workers import RewardWorkers
    local = [getattr(fn, "__name__", type(fn).__name__) for fn in fns
             if getattr(fn, "__module__", None) == "__main__" or type(fn).__module__ == "__main__"]
    why = f"{', '.join(local)} {'is' if len(local) == 1 else 'are'} defined in the script that runs " \
          "(__main__), which a worker does not import" if local else None
    if why is None:
        try:
            return RewardWorkers(fns, n, timeout_s, inline)
        except Exception as e:  # pickle's errors vary: PicklingError, TypeError, AttributeError
            why = f"they do not pickle ({type(e).__name__}: {e})"
    log.log(logging.WARNING if asked else logging.INFO, "reward functions score inline, not in %d worker "
            "processes: %s; define them in an importable module to score in workers", n, why)
    return None


def _unique(names: list[str]) -> list[str]:
    """``names`` with a repeated one numbered (``accuracy``, ``accuracy_2``): each function's value is kept apart."""
    seen: Counter = Counter()
    out = []
    for name in names:
        seen[name] += 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


@dataclass(frozen=True)
class _Call:
    """One scoring call's arguments, aligned by index."""

    prompts: list
    completions: list
    completion_ids: list
    columns: dict[str, list]

    def invoke(self, fn: RewardFn):
        """``fn``'s result (or awaitable). A function with a ``completions`` parameter is called as TRL calls it,
        everything by keyword (``def reward_len(completions, **kwargs)`` works); any other positionally."""
        columns = self.columns
        if "completion_ids" not in columns and _takes(fn, "completion_ids"):
            columns = {"completion_ids": self.completion_ids, **columns}
        if _named(fn, "completions"):
            return fn(prompts=self.prompts, completions=self.completions, **columns)
        return fn(self.prompts, self.completions, **columns)

    def split(self) -> list[_Call]:
        return [self.slice(i, i + 1) for i in range(len(self.completions))]

    def slice(self, start: int, stop: int) -> _Call:
        return _Call(self.prompts[start:stop], self.completions[start:stop], self.completion_ids[start:stop],
                     {k: v[start:stop] for k, v in self.columns.items()})

    def fields(self) -> tuple:
        return self.prompts, self.completions, self.completion_ids, self.columns


def _as_trl_completions(prompts: Sequence, completions: Sequence[str]) -> list:
    """TRL's form: a conversational prompt's completion is the assistant message."""
    return [[{"role": "assistant", "content": c}] if isinstance(p, list) else c
            for p, c in zip(prompts, completions, strict=True)]


def _takes(fn: RewardFn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword ``name`` (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: pass it, as TRL does
        return True
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _named(fn: RewardFn, name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` that can be passed by keyword."""
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                inspect.Parameter.KEYWORD_ONLY)


def _is_async(fn: RewardFn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def _await(awaitable):
    return await awaitable


def _run_coroutine(coroutine):
    """Run ``coroutine`` to completion from this synchronous code; in a thread of its own where this thread already
    runs an event loop (a notebook), since asyncio.run cannot nest."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def _checked(values, n: int) -> list[float | None | _Failed]:
    values = list(values)
    if len(values) != n:
        raise ValueError(f"returned {len(values)} values for {n} completions")
    return [None if v is None else _as_reward(v) for v in values]


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
