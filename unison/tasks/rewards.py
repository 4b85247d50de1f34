"""Reward functions: answer extraction, exact answers, partial credit, math answers.

A reward function takes the prompts, the completions and the dataset's other columns (lists aligned
with the prompts) and returns one float per completion, or None where it does not apply (a closeness
reward on a non-numeric answer); ``combine`` adds the weighted rewards that apply. A completion is a string,
or (TRL's conversational form) a list of messages whose last one holds the text.

>>> fmt = FormatReward()
>>> fmt(["What is 2 + 3?"], ["<answer>5</answer>"])
[1.0]
>>> combine([(fmt, 0.2)], ["q"], ["no tags"])
[0.0]
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation

RewardFn = Callable[..., list[float | None]]

_TAGGED = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_ANSWER_IS = re.compile(r"\banswer\b[^\n:=]{0,40}?(?:\bis\b\s*:?|:|=)\s*([^\n]+)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+−]?\d[\d,]*(?:\.\d+)?")
_DECORATION = " \t\n*`$\"'"


def extract_answer(completion: str) -> str | None:
    """The final answer in a completion, or None.

    In order: the last non-empty ``<answer>...</answer>``; the last ``\\boxed{...}``; the last
    ``answer is X`` / ``Answer: X`` (after its last ``=``); the last number. Measured on
    SmolLM2-135M-Instruct (bench/task_probe.py, one-digit sums): it wrote tags in 0-9% of completions
    and never put the bare answer on its first line, while this order found an answer in 84-100%.
    An unclosed ``<answer>`` is not trusted: the model writes "in <answer> tags." as prose.

    >>> extract_answer("3 + 4 = 7, so <answer> 7 </answer>")
    '7'
    >>> extract_answer("The answer is **12**.")
    '12'
    >>> extract_answer("5 + 2 = 7")
    '7'
    """
    tagged = [t for t in map(_clean, _TAGGED.findall(completion)) if t]  # "<answer></answer>" echoed back
    if tagged:
        return tagged[-1]
    boxed = last_boxed(completion)
    if boxed is not None:
        return _clean(boxed)
    said = _ANSWER_IS.findall(completion)
    if said:
        said = said[-1].rsplit("=", 1)[-1]  # "the answer is 6 + 10 = 16"
        number = _NUMBER.findall(said)
        return _clean(number[0] if number else said) or None
    return last_number(completion)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``, braces balanced; None if there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return _clean(numbers[-1]) if numbers else None


def to_number(text: str | None) -> float | None:
    """``"1,234"``, ``"+7."``, ``"−3"`` -> float; None if ``text`` is not one number."""
    if text is None:
        return None
    s = text.strip(_DECORATION).rstrip(".").replace(",", "").replace("−", "-")
    try:
        value = float(Decimal(s))
    except (InvalidOperation, ValueError):
        return None
    return value if math.isfinite(value) else None


def _clean(s: str) -> str:
    s = s.strip(_DECORATION)
    if s.endswith(".") and to_number(s[:-1]) is not None:
        s = s[:-1]
    return s.strip(_DECORATION)


class FormatReward:
    """1.0 for exactly one ``<answer>...</answer>`` with a non-empty answer and nothing after it,
    0.5 for tags with text after them or for several, 0.0 without a closed tag."""

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float | None]:
        return [_format_score(completion_text(c)) for c in completions]


def _format_score(completion: str) -> float:
    tagged = _TAGGED.findall(completion)
    if not tagged or not _clean(tagged[-1]):
        return 0.0
    tail = completion[completion.lower().rfind("</answer>") + len("</answer>"):]
    return 1.0 if len(tagged) == 1 and not tail.strip() else 0.5


class ExactAnswerReward:
    """``score(extracted, row) -> [0, 1]`` on the extracted answer; 0.0 when nothing is extracted.

    ``score`` defaults to string equality with the ``answer`` column after normalising numbers. Where
    the gold answer is a number only a full score counts: reasoning-gym's scorers give substring credit
    ("14" earns 0.5 for gold "4", "0123456789" earns 0.1 for any digit), a reward a policy can farm;
    ``ClosenessReward`` is the partial credit for numbers.
    """

    def __init__(self, score: Callable[[str, dict], float] | None = None):
        self.score = score or _equal_answer

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float | None]:
        out: list[float | None] = []
        for i, completion in enumerate(map(completion_text, completions)):
            answer = extract_answer(completion)
            row = {k: v[i] for k, v in columns.items()}
            score = 0.0 if answer is None else float(self.score(answer, row))
            if score < 1.0 and to_number(str(row.get("answer"))) is not None:
                score = 0.0
            out.append(score)
        return out


def _equal_answer(answer: str, row: dict) -> float:
    gold = str(row["answer"])
    a, g = to_number(answer), to_number(gold)
    if a is not None and g is not None:
        return float(a == g)
    return float(answer.strip().lower() == gold.strip().lower())


class ClosenessReward:
    """Partial credit for numeric answers: ``exp(-|pred - gold| / scale)``, ``scale = max(1, |gold|/10)``.

    So an answer off by one on a one-digit sum scores 0.37, off by three 0.05; None where the gold answer
    is not a number (the reward does not apply), 0.0 where the completion has no number.
    """

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float | None]:
        out: list[float | None] = []
        for completion, gold in zip(completions, columns["answer"], strict=True):
            g = to_number(str(gold))
            if g is None:
                out.append(None)
                continue
            p = to_number(extract_answer(completion_text(completion)))
            out.append(0.0 if p is None else math.exp(-abs(p - g) / max(1.0, abs(g) / 10)))
        return out


class MathReward:
    """1.0 if math-verify finds the completion's answer equal to the ``answer`` column, else 0.0.

    The extracted answer (tags, ``\\boxed{}``, ...) is checked first, then the whole completion. A gold
    answer that math-verify cannot parse is compared as a string.
    """

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float | None]:
        return [_math_equal(completion_text(c), str(g)) for c, g in zip(completions, columns["answer"], strict=True)]


class SoftOverlongPunishment:
    """TRL's ``get_soft_overlong_punishment`` (DAPO): 0 up to ``max_completion_len - soft_punish_cache`` tokens,
    then falling linearly to -1 at ``max_completion_len``, -1 past it.

    >>> SoftOverlongPunishment(10, 4)([""] * 3, [""] * 3, completion_ids=[[0] * 6, [0] * 8, [0] * 11])
    [0.0, -0.5, -1.0]
    """

    __name__ = "soft_overlong_punishment"

    def __init__(self, max_completion_len: int, soft_punish_cache: int):
        if not 0 < soft_punish_cache <= max_completion_len:
            raise ValueError(f"soft_overlong_punishment needs 0 < soft_punish_cache ({soft_punish_cache}) <= "
                             f"max_completion_len ({max_completion_len})")
        self.max_len, self.cache = max_completion_len, soft_punish_cache

    def __call__(self, prompts, completions, completion_ids, **columns) -> list[float | None]:
        free = self.max_len - self.cache
        return [0.0 if len(ids) <= free else (free - len(ids)) / self.cache if len(ids) <= self.max_len else -1.0
                for ids in completion_ids]


def completion_text(completion) -> str:
    """The text of a completion: a string, or TRL's conversational ``[{"role": "assistant", "content": ...}]``."""
    if isinstance(completion, list):
        return str(completion[-1]["content"]) if completion else ""
    return completion


def _math_equal(completion: str, gold: str) -> float:
    from math_verify import parse, verify

    gold_parsed = parse(gold) or parse(f"${gold}$")
    answer = extract_answer(completion)
    if not gold_parsed:  # not math: a plain answer ("Paris")
        return float(answer is not None and answer.strip().lower() == gold.strip().lower())
    candidates = [f"${answer}$", answer] if answer else []
    for text in [*candidates, completion]:
        parsed = parse(text)
        if parsed:
            return float(verify(gold_parsed, parsed))
    return 0.0


def combine(reward_fns: Sequence[tuple[RewardFn, float]], prompts: Sequence[str], completions: Sequence[str],
            **columns) -> list[float]:
    """Weighted sum of the rewards per completion; a None (does not apply) adds nothing."""
    total = [0.0] * len(completions)
    for fn, weight in reward_fns:
        values = fn(prompts, completions, **columns)
        if len(values) != len(completions):
            raise ValueError(f"{fn!r} returned {len(values)} rewards for {len(completions)} completions")
        for i, v in enumerate(values):
            if v is not None:
                total[i] += weight * float(v)
    return total
