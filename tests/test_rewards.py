"""Reward scoring and group advantages on hostile values: huge, non-finite, non-numeric, always failing."""

from __future__ import annotations

import logging
import math
import random

import numpy as np
import pytest
import torch

from unison.rollout import rewards
from unison.rollout.advantage import group_advantages
from unison.rollout.rewards import RewardScorer


def unscaled_advantages(rs, eps=1e-6):
    """The textbook formula, exact wherever its squares and sums stay in the float range."""
    mean = sum(rs) / len(rs)
    std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
    return [(r - mean) / (std + eps) for r in rs]


def test_huge_rewards_get_the_advantages_of_their_scaled_down_values():
    # (eps=0 in the reference: against rewards of 1e300 an eps of 1e-6 is nothing)
    assert group_advantages([1e300, -1e300, 0.0]) == pytest.approx(unscaled_advantages([1.0, -1.0, 0.0], eps=0))
    # Their sum overflows too, not only their squares.
    top = 1.7976931348623157e308
    assert group_advantages([top, top, -top, 0.0]) == pytest.approx(unscaled_advantages([1.0, 1.0, -1.0, 0.0], eps=0))


def test_ordinary_and_tiny_rewards_get_the_unscaled_formulas_advantages_bit_for_bit():
    rng = random.Random(0)
    for scale in (1.0, 1e-3, 10.0, 1e6, 1e-200):
        for size in (2, 3, 8, 16):
            rs = [rng.uniform(-1, 1) * scale for _ in range(size)]
            assert group_advantages(rs) == unscaled_advantages(rs), (scale, size)
    assert group_advantages([0.0, 1.0, 1.0, 0.25], eps=0.5) == unscaled_advantages([0.0, 1.0, 1.0, 0.25], eps=0.5)


def test_non_finite_rewards_are_an_error_not_nan_advantages():
    for bad in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="rewards must be finite"):
            group_advantages([0.0, 1.0, bad])


def returns(*values, name="fn"):
    def fn(prompts, completions, **_):
        return list(values)
    fn.__name__ = name
    return fn


@pytest.mark.parametrize("value", [1, 0.5, True, np.float32(0.5), np.int64(2), np.bool_(True), np.array(0.5),
                                   torch.tensor(0.5), torch.tensor(3)])
def test_numbers_of_any_kind_are_rewards(value):
    assert RewardScorer([(returns(value), 1.0)]).score(["p"], ["c"], {})[0][0] == float(value)


@pytest.mark.parametrize("value,why", [
    ("1.0", "returned str '1.0', not a number"),
    ([1.0], "returned list [1.0], not a number"),
    (torch.tensor([0.5]), "returned Tensor tensor([0.5000]), not a number"),
    (1 + 2j, "returned complex (1+2j), not a number"),
    (float("nan"), "returned NaN"),
    (float("inf"), "returned inf"),
    pytest.param(10 ** 400, "int with no float value (OverflowError: int too large", id="int-past-float-range"),
])
def test_non_numeric_and_non_finite_results_are_failures(value, why):
    scorer = RewardScorer([(returns(value), 1.0)])
    assert scorer.score(["p"], ["c"], {}) == [(None, {})]
    assert scorer.missing["fn"] == 1 and why in scorer.last_failure["fn"]


def test_a_total_past_the_float_range_is_a_failure_of_the_function_that_overflowed_it():
    def big(prompts, completions, **_):
        return [1e308] * len(completions)

    def bigger(prompts, completions, **_):
        return [1e308] * len(completions)

    scorer = RewardScorer([(big, 1.0), (bigger, 1.0)])
    assert scorer.score(["p"], ["c"], {}) == [(None, {"big": 1e308})]
    assert scorer.missing == {"bigger": 1} and "float range" in scorer.last_failure["bigger"]


def always_raises(prompts, completions, **_):
    return [1 / 0 for _ in completions]


def test_nan_results_are_logged_with_the_function_name(caplog):
    nan = RewardScorer([(returns(float("nan"), name="judge"), 1.0)])
    with caplog.at_level(logging.WARNING, logger=rewards.__name__):
        nan.score(["p"], ["c"], {})
    assert [r.getMessage() for r in caplog.records] == ["reward function judge failed: returned NaN"]


def test_a_function_that_always_fails_never_floods_the_log(caplog):
    scorer = RewardScorer([(always_raises, 1.0)])
    with caplog.at_level(logging.WARNING, logger=rewards.__name__):
        for _ in range(100):
            scorer.score(["p"] * 8, ["c"] * 8, {})
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) < 10  # not one per completion (800)
    assert len(messages) <= rewards.LOG_FIRST_FAILURES + 1 and scorer.missing["always_raises"] == 800
    assert all(m.startswith("reward function always_raises failed") for m in messages)
    assert "ZeroDivisionError: division by zero" in messages[0]


def test_later_failures_are_summarised_with_their_count(caplog, monkeypatch):
    monkeypatch.setattr(rewards, "SUMMARY_EVERY_S", 0.0)
    scorer = RewardScorer([(always_raises, 1.0)])
    with caplog.at_level(logging.WARNING, logger=rewards.__name__):
        scorer.score(["p"] * (rewards.LOG_FIRST_FAILURES + 2), ["c"] * (rewards.LOG_FIRST_FAILURES + 2), {})
    summary = caplog.records[-1].getMessage()
    assert summary.startswith("reward function always_raises failed on 1 more completions")
    assert f"{rewards.LOG_FIRST_FAILURES + 2} of {rewards.LOG_FIRST_FAILURES + 2} so far" in summary
    assert "last: ZeroDivisionError: division by zero" in summary


def test_the_missing_report_names_each_failing_function_its_count_and_last_error():
    scorer = RewardScorer([(always_raises, 1.0), (returns(1.0, name="ok"), 1.0),
                           (returns(float("nan"), name="nan"), 1.0)])
    assert scorer.missing_report() == ""
    scorer.score(["p"], ["c"], {})
    scorer.score(["p"], ["c"], {})
    assert scorer.missing_report() == ("reward function always_raises failed on 2 of 2 completions (last: "
                                       "ZeroDivisionError: division by zero); reward function nan failed on 2 of 2 "
                                       "completions (last: returned NaN)")


def test_the_missing_report_counts_completions_no_function_applied_to():
    def applies_to_numbers(prompts, completions, **_):
        return [1.0 if c.isdigit() else None for c in completions]

    scorer = RewardScorer([(applies_to_numbers, 1.0)])
    assert [r for r, _ in scorer.score(["p"] * 3, ["1", "x", "y"], {})] == [1.0, None, None]
    assert scorer.missing_report() == "no reward function applied to 2 of 3 completions (each returned None)"
