"""The rollout loop: scoring, failure isolation, group advantages, zero-std drop, staleness."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
from conftest import tiny_llama, tiny_tokenizer

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.rollout import remote
from unison.rollout.advantage import group_advantages
from unison.rollout.loop import RolloutConfig, RolloutLoop, encode_prompt
from unison.rollout.rewards import RewardScorer, Scored


def count_w7(prompts, completions, **_):
    """Varies across samples of a random model: how often the word w7 appears... plus its length, finely."""
    return [c.split().count("w7") + 0.01 * len(c.split()) for c in completions]


def rows(n=6):
    return [{"prompt": " ".join(f"w{3 + (i * 7 + j) % 200}" for j in range(5 + i)), "answer": str(i)}
            for i in range(n)]


def make_loop(reward_fns, max_sample_tokens=None, scorer=None, agreement=None, **cfg):
    engine = Engine(tiny_llama(), EngineConfig(num_blocks=256, block_size=4, seed=0))
    base = dict(group_size=4, samples_per_step=8, max_concurrent_rollouts=8, max_new_tokens=10)
    base.update(cfg)
    return RolloutLoop(engine, tiny_tokenizer(), rows(), reward_fns, RolloutConfig(**base), stop_token_ids=[2],
                       max_sample_tokens=max_sample_tokens, scorer=scorer, agreement=agreement)


def test_batches_have_group_advantages_and_engine_logprobs():
    loop = make_loop([(count_w7, 1.0)])
    batch, metrics = loop.next_batch(trainer_version=0)
    assert len(batch) == 8
    by_group = {}
    for s in batch:
        by_group.setdefault(s.group_id, []).append(s)
        assert len(s.engine_logprobs) == len(s.completion_ids) and all(lp <= 0 for lp in s.engine_logprobs)
    for group in by_group.values():
        if len(group) == 4:  # a whole group: advantages are standardised within it
            assert abs(sum(s.advantage for s in group)) < 1e-6
            assert math.isclose(sum(s.advantage ** 2 for s in group) / 4, 1.0, rel_tol=1e-2)
    assert metrics["reward/mean"] > 0 and metrics["rollout/groups"] >= 2


def test_failing_reward_functions_are_counted_not_fatal():
    calls = {"n": 0}

    def flaky(prompts, completions, answer, **_):
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise RuntimeError("verifier crashed")
        if calls["n"] % 3 == 1:
            return [float("nan")]
        return [1.0]

    def wrong_length(prompts, completions, **_):
        return [1.0, 2.0]

    scorer = RewardScorer([(count_w7, 1.0), (flaky, 0.5)])
    results = [scorer.score(["p"], ["w7 w7"], {"answer": ["1"]})[0] for _ in range(3)]
    assert [r for r, _ in results] == [None, 2.02 + 0.5, None]
    assert scorer.missing["flaky"] == 2 and results[0][1] == {"count_w7": 2.02}
    bad = RewardScorer([(wrong_length, 1.0)])
    assert bad.score(["p"], ["c"], {})[0][0] is None and bad.missing["wrong_length"] == 1

    def not_applicable(prompts, completions, **_):
        return [None] * len(completions)

    # None means "does not apply": it adds nothing and is not a failure; with nothing applying, no reward.
    partial = RewardScorer([(count_w7, 1.0), (not_applicable, 5.0)])
    assert partial.score(["p"], ["w7"], {})[0] == (pytest.approx(1.01), {"count_w7": pytest.approx(1.01)})
    assert partial.missing["not_applicable"] == 0
    assert RewardScorer([(not_applicable, 1.0)]).score(["p"], ["w7"], {})[0][0] is None

    def rarely_failing(prompts, completions, **_):
        calls["n"] += 1
        return [float("nan")] if calls["n"] % 5 == 0 else [0.0]

    def chokes_on_w9(prompts, completions, **_):
        if any("w9" in c for c in completions):
            raise ValueError("unparseable")
        return [1.0] * len(completions)

    # A batch it fails on is scored one completion at a time: only the completion it fails on loses its reward.
    isolating = RewardScorer([(chokes_on_w9, 1.0)])
    assert [r for r, _ in isolating.score(["p"] * 3, ["w7", "w9", "w8"], {})] == [1.0, None, 1.0]
    assert isolating.missing["chokes_on_w9"] == 1

    loop = make_loop([(count_w7, 1.0), (rarely_failing, 1.0)])
    batch, metrics = loop.next_batch(trainer_version=0)
    assert len(batch) == 8 and metrics["rollout/missing_reward"] > 0


def test_zero_std_groups_are_dropped_and_counted():
    def constant(prompts, completions, **_):
        return [1.0] * len(completions)

    loop = make_loop([(constant, 1.0)])
    with pytest.raises(RuntimeError, match="without spread"):
        loop.next_batch(trainer_version=0)  # no group can ever carry signal: an error, not an endless loop
    assert loop.counts["zero_std_groups"] >= 12 and not loop.ready


def test_stale_samples_are_dropped():
    loop = make_loop([(count_w7, 1.0)], max_staleness=0, samples_per_step=4, max_concurrent_rollouts=16)
    first, _ = loop.next_batch(trainer_version=0)
    assert all(s.oldest_version == 0 for s in first)
    loop.engine.weights_updated(1)
    batch, metrics = loop.next_batch(trainer_version=1)
    assert all(s.oldest_version == 1 for s in batch)
    assert metrics["rollout/stale_samples"] > 0 and metrics["rollout/staleness_max"] == 0


class OpaqueIds:
    """The engine under other ids, with no structure to parse (a remote engine may spell its ids any way)."""

    def __init__(self, engine: Engine):
        self.engine, self.ids = engine, {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def submit(self, prompt_ids, params=None):
        ids = self.engine.submit(prompt_ids, params)
        self.ids.update({rid: f"#{len(self.ids) + i}" for i, rid in enumerate(ids)})
        return [self.ids[rid] for rid in ids]

    def step(self):
        return [dataclasses.replace(c, request_id=self.ids[c.request_id], group_id=f"group {c.group_id}")
                for c in self.engine.step()]


def test_groups_are_the_ids_the_engine_gives_never_parsed_out_of_request_ids():
    loop = make_loop([(count_w7, 1.0)])
    loop.engine = OpaqueIds(loop.engine)
    batch, _ = loop.next_batch(trainer_version=0)
    groups = {}
    for s in batch:
        groups.setdefault(s.group_id, []).append(s.advantage)
    assert all(g.startswith("group ") for g in groups) and all(len(a) <= 4 for a in groups.values())
    assert all(abs(sum(a)) < 1e-6 for a in groups.values() if len(a) == 4)


def test_remote_engine_aborts_a_queued_group_unsent_and_drops_aborted_samples_of_a_sent_one(monkeypatch):
    sent, release = [], threading.Event()

    def post_json(url, payload, timeout, token):
        sent.append(payload["prompt"])
        release.wait(10)
        return {"choices": [{"token_ids": [5], "logprobs": [-0.5], "finish_reason": "stop", "weight_versions": [3]}]
                * payload["n"]}

    monkeypatch.setattr(remote, "post_json", post_json)
    engine = remote.RemoteEngine(["http://server"], max_parallel=1)
    first = engine.submit([1, 2], SamplingParams(n=2))
    queued = engine.submit([3], SamplingParams(n=2))  # behind the first on the one worker thread
    assert engine.abort([first[1], *queued, "unknown"]) == 3 and engine.num_unfinished == 1
    aborted = engine.step()
    assert {(c.request_id, c.group_id, c.finish_reason, len(c.token_ids)) for c in aborted} == \
        {(first[1], "r0", "abort", 0), (queued[0], "r1", "abort", 0), (queued[1], "r1", "abort", 0)}
    release.set()
    done = [c for _ in range(100) if engine.num_unfinished for c in engine.step(wait_s=0.1)]
    assert [(c.request_id, c.group_id, c.token_ids) for c in done] == [(first[0], "r0", [5])] and sent == [[1, 2]]
    with engine.lend() as lent:
        assert lent == 0
    engine.weights_updated(4)
    assert engine.version == 4
    engine.close()


def test_group_advantages():
    assert group_advantages([1.0, 1.0, 1.0]) is None
    assert group_advantages([0.1] * 8) is None
    adv = group_advantages([0.0, 1.0])
    assert adv == pytest.approx([-1.0, 1.0], abs=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    ({"group_size": 4, "samples_per_step": 6}, "multiple of group_size"),
    ({"group_size": 1}, "group_size"),
    ({"max_concurrent_rollouts": 2}, "at least one group"),
    ({"temperature": -1.0}, "temperature"),
])
def test_rollout_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RolloutConfig(**kwargs)


def test_prompt_longer_than_context_is_skipped_and_counted():
    loop = make_loop([(count_w7, 1.0)])
    loop.rows.append({"prompt": " ".join(["w9"] * 600), "answer": "x"})
    loop.order = [len(loop.rows) - 1]  # the long one comes first
    batch, metrics = loop.next_batch(trainer_version=0)
    assert len(batch) == 8 and metrics["rollout/skipped_prompts"] >= 1


def test_samples_never_outgrow_the_training_row():
    """A long prompt's completion is cut to fit the trainer's packed row (finish "length"); a prompt that fills the
    row is skipped and counted, not a crash of the training step."""
    loop = make_loop([(count_w7, 1.0)], max_sample_tokens=14, samples_per_step=16)
    prompt_tokens = [len(encode_prompt(loop.tokenizer, r["prompt"])) for r in loop.rows]
    assert max(prompt_tokens) > 14 - 10 and min(prompt_tokens) < 14  # some are cut, some fit
    loop.rows.append({"prompt": " ".join(["w9"] * 20), "answer": "x"})
    loop.order = [len(loop.rows) - 1]  # the too-long one comes first
    batch, metrics = loop.next_batch(trainer_version=0)
    assert all(s.num_tokens <= 14 for s in batch)
    assert any(len(s.completion_ids) < 10 and s.finish_reason == "length" for s in batch)
    assert metrics["rollout/skipped_prompts"] >= 1


def test_no_usable_prompt_is_an_error_not_a_hang():
    loop = make_loop([(count_w7, 1.0)])
    loop.rows[:] = [{"prompt": " ".join(["w9"] * 600), "answer": "x"}] * 3
    loop.order = []
    with pytest.raises(RuntimeError, match="no prompt can be rolled out"):
        loop.next_batch(trainer_version=0)
    assert loop.counts["skipped_prompts"] == 3


def always_divides_by_zero(prompts, completions, **_):
    return [1 / 0 for _ in completions]


def always_nan(prompts, completions, **_):
    return [float("nan")] * len(completions)


@pytest.mark.parametrize("fn,why", [(always_divides_by_zero, "ZeroDivisionError: division by zero"),
                                    (always_nan, "returned NaN")])
def test_no_batch_error_names_the_reward_function_that_never_scored(fn, why):
    loop = make_loop([(count_w7, 1.0), (fn, 1.0)])
    with pytest.raises(RuntimeError) as error:
        loop.next_batch(trainer_version=0)
    n = loop.counts["missing_reward"]
    assert str(error.value).startswith(f"two passes over the prompts gave no batch: reward function {fn.__name__} "
                                       f"failed on {n} of {n} completions (last: {why}); ")
    assert n >= 24 and loop.scorer.missing[fn.__name__] == loop.scorer.scored == n


def test_no_batch_error_says_when_no_reward_function_applied():
    def never_applies(prompts, completions, **_):
        return [None] * len(completions)

    loop = make_loop([(never_applies, 1.0)])
    with pytest.raises(RuntimeError, match=r"no batch: no reward function applied to (\d+) of \1 completions"):
        loop.next_batch(trainer_version=0)


def test_reward_failures_per_function_are_step_metrics():
    def fails_on_w9(prompts, completions, **_):
        return [math.nan if "w9" in c else 0.0 for c in completions]

    loop = make_loop([(count_w7, 1.0), (fails_on_w9, 1.0)])
    _, metrics = loop.next_batch(trainer_version=0)
    assert metrics["reward/failed/count_w7"] == 0.0
    assert metrics["reward/failed/fails_on_w9"] == loop.scorer.missing["fails_on_w9"] > 0


def test_no_batch_error_on_a_rank_that_does_not_score_points_to_the_one_that_does():
    class OtherRanksScores:  # what a tensor-parallel rank other than 0 gets: rank 0's results, none of its counts
        def score(self, prompts, completions, columns, completion_ids=None):
            return [(None, {})] * len(completions)

        def submit(self, prompts, completions, columns, completion_ids=None):
            return Scored(self.score(prompts, completions, columns, completion_ids))

        def missing_report(self):
            return None  # rank 0 holds the report

    loop = make_loop([(count_w7, 1.0)], scorer=OtherRanksScores())
    with pytest.raises(RuntimeError, match="no batch: the rewards were scored on another rank, whose error names"):
        loop.next_batch(trainer_version=0)
