"""Reward functions named in the config: ``rewards: [{fn: "package.module:function", weight: 1.0}]``.

``fn`` is an importable ``module:attribute`` (or ``module.attribute``) or one of unison's built-ins (``BUILTINS``).
The function has TRL's reward signature, so a TRL reward function is used unchanged:

    def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float | None]: ...

``kwargs`` are the dataset row's other columns, one list per column (``answer``, ``solution``, ...). An ``async def``
function is awaited; all async functions of a batch run concurrently. With ``args`` the named object is a factory
called once at startup with them, returning the reward function (a class is instantiated with them):

    rewards:
      - {fn: accuracy}                                     # math-verify against the answer column
      - {fn: format, weight: 0.1}                          # <answer>...</answer>
      - {fn: soft_overlong_punishment, args: {soft_punish_cache: 16}}
      - {fn: "trl.rewards:get_soft_overlong_punishment", args: {max_completion_len: 64, soft_punish_cache: 16}}

A name that does not import, or names nothing callable, is a ``ConfigError`` when the config loads.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..tasks.rewards import ClosenessReward, ExactAnswerReward, FormatReward, MathReward, SoftOverlongPunishment
from .rewards import RewardFn


def _soft_overlong(max_new_tokens: int, max_completion_len: int | None = None,
                   soft_punish_cache: int | None = None) -> SoftOverlongPunishment:
    """TRL's soft overlong punishment; ``max_completion_len`` defaults to ``rollout.max_new_tokens`` and
    ``soft_punish_cache`` to a fifth of it (DAPO's 4k of 20k)."""
    length = max_completion_len or max_new_tokens
    return SoftOverlongPunishment(length, soft_punish_cache or max(1, length // 5))


BUILTINS: dict[str, Callable[..., RewardFn]] = {
    "accuracy": lambda max_new_tokens, **args: MathReward(**args),
    "exact": lambda max_new_tokens, **args: ExactAnswerReward(**args),
    "closeness": lambda max_new_tokens, **args: ClosenessReward(**args),
    "format": lambda max_new_tokens, **args: FormatReward(**args),
    "soft_overlong_punishment": _soft_overlong,
}
"""Built-in reward names -> factory(max_new_tokens, **args): ``accuracy`` (math-verify equality with the ``answer``
column; a non-math answer compared as text), ``exact`` (the extracted answer equals ``answer``), ``closeness``
(partial credit for numbers), ``format`` (one ``<answer>...</answer>``), ``soft_overlong_punishment`` (TRL's, DAPO)."""


@dataclass
class RewardSpec:
    fn: str
    """A built-in (accuracy, exact, closeness, format, soft_overlong_punishment) or "package.module:function" with
    TRL's signature ``(prompts, completions, completion_ids, **columns) -> list[float | None]``."""
    weight: float = 1.0
    """Multiplies this function's value in the summed reward."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments: ``fn`` is then a factory (or class) called with them once at startup."""

    def __post_init__(self):
        if not math.isfinite(self.weight):
            raise ValueError(f"weight must be a finite number, got {self.weight}")
        resolve(self.fn)  # fails at config time, naming the string


def resolve(name: str) -> Callable:
    """The built-in factory or the object ``name`` imports to; ValueError naming ``name`` otherwise."""
    if name in BUILTINS:
        return BUILTINS[name]
    module_name, colon, attr = name.partition(":")
    if not colon:
        module_name, _, attr = name.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"fn={name!r} is neither a built-in reward ({', '.join(BUILTINS)}) nor "
                         "'package.module:function'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or the module itself failing on import
        raise ValueError(f"fn={name!r}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"fn={name!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"fn={name!r} is a {type(obj).__name__}, not a callable reward function")
    return obj


def build_reward_fns(specs: list[RewardSpec], max_new_tokens: int) -> list[tuple[RewardFn, float]]:
    """The ``(fn, weight)`` pairs of ``specs``: built-ins made, factories and classes called with their ``args``."""
    out = []
    for i, spec in enumerate(specs):
        obj = resolve(spec.fn)
        try:
            if spec.fn in BUILTINS:
                fn = obj(max_new_tokens, **spec.args)
            elif spec.args or inspect.isclass(obj):
                fn = obj(**spec.args)
            else:
                fn = obj
        except (TypeError, ValueError) as e:
            raise ValueError(f"rewards[{i}] ({spec.fn}): {e}") from None
        if not callable(fn):
            raise ValueError(f"rewards[{i}] ({spec.fn}) with args {spec.args} returned a {type(fn).__name__}, not a "
                             "reward function")
        out.append((fn, spec.weight))
    return out
