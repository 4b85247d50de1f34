"""Reward functions named in the config: TRL's signature unchanged, async ones awaited together, bad names refused."""

from __future__ import annotations

import asyncio
import time

import pytest

from unison.config import ConfigError, load_config
from unison.rollout.reward_config import build_reward_fns
from unison.rollout.rewards import RewardScorer
from unison.train.config import TrainConfig


# Written as TRL's documentation writes reward functions: everything arrives by keyword.
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def ids_and_solution(prompts, completions, completion_ids, solution, **kwargs):
    return [float(len(ids)) + (c == s) for c, ids, s in zip(completions, completion_ids, solution, strict=True)]


def conversational(prompts, completions, **kwargs):
    return [float(p[-1]["content"] == "hi" and c[0]["role"] == "assistant" and c[0]["content"] == "yo")
            for p, c in zip(prompts, completions, strict=True)]


async def slow_len(prompts, completions, **kwargs):
    await asyncio.sleep(0.3)
    return [float(len(c)) for c in completions]


async def slow_parity(prompts, completions, **kwargs):
    await asyncio.sleep(0.3)
    if any(c == "boom" for c in completions):
        raise RuntimeError("sandbox down")
    return [float(len(c) % 2) for c in completions]


def test_trl_reward_functions_from_the_yaml_are_used_unchanged(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("rewards:\n"
                      "  - {fn: 'test_reward_config:reward_len', weight: 0.5}\n"
                      "  - fn: test_reward_config.ids_and_solution\n")
    cfg = load_config(TrainConfig, config)
    assert [(r.fn, r.weight) for r in cfg.rewards] == [("test_reward_config:reward_len", 0.5),
                                                       ("test_reward_config.ids_and_solution", 1.0)]
    scorer = RewardScorer(build_reward_fns(cfg.rewards, max_new_tokens=64))
    out = scorer.score(["p", "q"], ["x" * 18, "ok"], {"solution": ["nope", "ok"]}, [[5, 6, 7], [8]])
    assert out == [(0.5 * -2 + 3.0, {"reward_len": -2, "ids_and_solution": 3.0}),
                   (0.5 * -18 + 2.0, {"reward_len": -18, "ids_and_solution": 2.0})]
    # A conversational prompt: the completion comes as TRL passes it, the assistant message.
    chat = RewardScorer(build_reward_fns(load_config(TrainConfig, None, [
        "--rewards=[{fn: 'test_reward_config:conversational'}]"]).rewards, 64))
    assert chat.score([[{"role": "user", "content": "hi"}]], ["yo"], {})[0][0] == 1.0


def test_async_reward_functions_are_awaited_together_and_failures_isolated():
    scorer = RewardScorer([(slow_len, 1.0), (slow_parity, 10.0)])
    t0 = time.perf_counter()
    out = scorer.score(["p"] * 3, ["abc", "boom", "ab"], {})
    elapsed = time.perf_counter() - t0
    # Both functions, and the one-at-a-time retries of the failing one, ran concurrently: ~2 x 0.3 s, not 5 x 0.3 s.
    assert elapsed < 1.2, elapsed
    assert out[0] == (3.0 + 10.0, {"slow_len": 3.0, "slow_parity": 1.0})
    assert out[1] == (None, {"slow_len": 4.0})
    assert out[2] == (2.0, {"slow_len": 2.0, "slow_parity": 0.0})
    assert scorer.missing["slow_parity"] == 1 and "sandbox down" in scorer.missing_report()


@pytest.mark.parametrize("fn, why", [
    ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
    ("test_reward_config:no_such_function", "has no attribute 'no_such_function'"),
    ("math:pi", "is a float, not a callable"),
    ("accuracy_typo", "neither a built-in reward"),
])
def test_a_bad_reward_name_is_a_config_error_naming_it(fn, why):
    with pytest.raises(ConfigError, match=rf"rewards\[0\].*{why}"):
        load_config(TrainConfig, None, [f"--rewards=[{{fn: '{fn}'}}]"])


def test_built_in_rewards():
    fns = dict((type(fn).__name__, fn) for fn, _ in build_reward_fns(load_config(TrainConfig, None, [
        "--rewards=[{fn: accuracy}, {fn: format, weight: 0.1}, "
        "{fn: soft_overlong_punishment, args: {max_completion_len: 10, soft_punish_cache: 4}}]"]).rewards, 64))
    assert fns["MathReward"](["q"] * 2, ["so \\boxed{\\frac{1}{2}}", "0.3"], answer=["0.5", "0.5"]) == [1.0, 0.0]
    assert fns["FormatReward"](["q"], [[{"role": "assistant", "content": "<answer>4</answer>"}]]) == [1.0]
    overlong = fns["SoftOverlongPunishment"]
    # TRL's formula: 0 up to max - cache, then (max - cache - len) / cache, -1 past max.
    lengths = [1, 6, 7, 9, 10, 11, 40]
    expected = [0.0 if n <= 6 else (6 - n) / 4 if n <= 10 else -1.0 for n in lengths]
    assert overlong(["q"] * 7, [""] * 7, completion_ids=[[0] * n for n in lengths]) == expected
    default, _ = build_reward_fns(load_config(TrainConfig, None, [
        "--rewards=[{fn: soft_overlong_punishment}]"]).rewards, max_new_tokens=50)[0]
    assert (default.max_len, default.cache) == (50, 10)  # rollout.max_new_tokens, a fifth of it


def test_a_function_named_twice_keeps_both_values():
    cfg = load_config(TrainConfig, None, ["--rewards=[{fn: 'test_reward_config:reward_len'}, "
                                          "{fn: 'test_reward_config:reward_len', weight: 2.0}]"])
    scorer = RewardScorer(build_reward_fns(cfg.rewards, 64))
    assert scorer.score(["p"], ["x" * 19], {}) == [(-3.0, {"reward_len": -1, "reward_len_2": -1})]
