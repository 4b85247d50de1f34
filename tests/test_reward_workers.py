"""Reward functions in worker processes (rollout.reward_workers): the same rewards as inline, failures of a
worker (an exit, a hang, functions that do not load there) counted and never fatal, and the rollout loop's batches
unchanged."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import worker_rewards as wr
from test_rollout import make_loop

from unison.rollout.rewards import RewardScorer
from unison.train.reporting import CompletionLog

COMPLETIONS = [f"w7 {'w7 ' * i}x" for i in range(7)]
PROMPTS = [f"p{i}" for i in range(7)]
ANSWERS = {"answer": [str(i) for i in range(7)]}


def test_workers_score_as_inline_split_over_processes():
    fns = [(wr.count_w7, 1.0), (wr.length, 0.5), (wr.pid, 0.0)]
    inline = RewardScorer(fns).score(PROMPTS, COMPLETIONS, ANSWERS)
    scorer = RewardScorer(fns, workers=3)
    try:
        pending = scorer.submit(PROMPTS, COMPLETIONS, ANSWERS)
        pooled = pending.result()
        assert pending.done()
        assert [(r, {k: v for k, v in p.items() if k != "pid"}) for r, p in pooled] == \
            [(r, {k: v for k, v in p.items() if k != "pid"}) for r, p in inline]
        pids = [p["pid"] for _, p in pooled]
        assert len(set(pids)) == 3 and os.getpid() not in pids  # 7 completions in chunks of 2, 2 and 3
        assert scorer.scored == 7 and not scorer.missing
    finally:
        scorer.close()
    assert all(w is None for w in scorer.workers.slots)


def test_a_worker_that_exits_costs_its_batch_only():
    scorer = RewardScorer([(wr.exits_on_boom, 1.0)], workers=1)
    try:
        assert scorer.score(["p"], ["fine"], {}) == [(1.0, {"exits_on_boom": 1.0})]
        assert scorer.score(["p", "p"], ["boom", "fine"], {}) == [(None, {}), (None, {})]
        assert scorer.missing["exits_on_boom"] == 2
        assert "exited (code 3) while scoring" in scorer.missing_report()
        assert scorer.score(["p"], ["fine again"], {}) == [(1.0, {"exits_on_boom": 1.0})]  # a new worker
        assert scorer.workers.restarts == 1 and scorer.workers.broken is None
    finally:
        scorer.close()


def test_a_hung_worker_is_stopped_after_the_timeout():
    scorer = RewardScorer([(wr.hangs_on_slow, 1.0)], workers=2, timeout_s=3.0)
    try:
        slow = scorer.submit(["p"], ["slow"], {})
        fast = scorer.submit(["p"], ["fast"], {})
        assert fast.result() == [(1.0, {"hangs_on_slow": 1.0})]  # the other worker goes on meanwhile
        assert not slow.done()
        assert slow.result() == [(None, {})]
        assert "took more than 3 s" in scorer.missing_report()
        assert scorer.score(["p"], ["fast"], {}) == [(1.0, {"hangs_on_slow": 1.0})]
    finally:
        scorer.close()


def test_a_batchs_clock_starts_when_its_worker_has_loaded_the_functions(monkeypatch):
    monkeypatch.setenv("WORKER_REWARDS_LOAD_S", "1.5")  # the import takes 1.5 s in a worker, scoring 1.5 s more
    scorer = RewardScorer([(wr.takes, 1.0)], workers=1, timeout_s=2.5)
    try:  # sent at once, before the worker is ready: 3 s and more after it was sent, under 2.5 s of scoring
        assert scorer.submit(["p"], ["1.5"], {}).result() == [(1.0, {"takes": 1.0})]
        assert scorer.workers.restarts == 0 and not scorer.missing
    finally:
        scorer.close()


def test_a_worker_that_does_not_load_within_the_timeout_turns_scoring_inline(monkeypatch):
    monkeypatch.setenv("WORKER_REWARDS_LOAD_S", "30")
    scorer = RewardScorer([(wr.pid, 1.0)], workers=1, timeout_s=1.0)
    try:
        t = time.monotonic()
        assert scorer.score(["p"], ["c"], {}) == [(os.getpid(), {"pid": os.getpid()})]  # here, not lost
        assert time.monotonic() - t < 10 and "did not load the reward functions in 1 s" in scorer.workers.broken
        assert all(w is None for w in scorer.workers.slots)  # stopped
    finally:
        scorer.close()


def test_functions_that_cannot_travel_score_inline(caplog, monkeypatch):
    with caplog.at_level(logging.WARNING):
        scorer = RewardScorer([(lambda prompts, completions, **_: [2.0] * len(completions), 1.0)], workers=2)
    assert scorer.workers is None and "do not pickle" in caplog.text
    assert scorer.score(["p"], ["c"], {})[0][0] == 2.0
    # Functions that pickle here and do not load in a worker: the workers give up, the call is scored inline.
    monkeypatch.setenv("WORKER_REWARDS_REFUSE", "1")
    scorer = RewardScorer([(wr.count_w7, 1.0), (wr.pid, 0.0)], workers=1)
    try:
        with caplog.at_level(logging.WARNING):
            scored = scorer.score(["p"], ["w7 w7"], {})
        assert scored[0][0] == pytest.approx(2.02) and scored[0][1]["pid"] == os.getpid()
        assert "could not load the reward functions" in scorer.workers.broken
        assert "refuses to load in a reward worker" in caplog.text
    finally:
        scorer.close()


def test_a_batch_whose_columns_do_not_pickle_scores_inline():
    scorer = RewardScorer([(wr.pid, 1.0)], workers=1)
    try:
        lock = threading.Lock()  # a live object in a row (an environment's handle): it cannot travel
        assert scorer.score(["p"], ["c"], {"handle": [lock]})[0][0] == os.getpid()
        assert scorer.score(["p"], ["c"], {"handle": ["text"]})[0][0] != os.getpid()
    finally:
        scorer.close()


def test_the_completion_log_shows_the_trained_batch_as_its_workers_scored_it(tmp_path):
    loop = make_loop([(wr.count_w7, 1.0), (wr.length, 0.5)], reward_workers=1)
    try:
        batch, _ = loop.next_batch(trainer_version=0)
    finally:
        loop.scorer.close()
    by_prompt = {row["prompt"]: row["answer"] for row in loop.rows}
    for s in batch:  # what the workers scored and the loop filed, sample by sample
        text = loop.tokenizer.decode(list(s.completion_ids), skip_special_tokens=True)
        assert s.shown["completion"].strip() == text.strip() and s.shown["answer"] == by_prompt[s.shown["prompt"]]
        parts = {name: s.shown[f"reward/{name}"] for name in ("count_w7", "length")}
        assert s.shown["reward"] == s.reward == pytest.approx(parts["count_w7"] + 0.5 * parts["length"])
        assert parts["count_w7"] == wr.count_w7([], [s.shown["completion"]])[0]

    class Writer:
        logged = []

        def log_completions(self, step, records):
            self.logged.append((step, records))

    log = CompletionLog(str(tmp_path), every=2, per_log=3, writer=Writer())
    log.after_step(1, batch)
    assert not Writer.logged and not (tmp_path / "completions.jsonl").exists()  # not a logging step
    log.after_step(2, batch)
    ((step, records),) = Writer.logged
    groups = [s.group_id for s in batch]
    assert step == 2 and len(records) == 3 and len(set(groups)) == 2  # two groups of 4: one of each, then a second
    firsts = [batch[groups.index(g)] for g in dict.fromkeys(groups)]
    assert [(r["completion"], r["advantage"]) for r in records[:2]] == [(s.shown["completion"], s.advantage)
                                                                         for s in firsts]
    written = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert written == [json.loads(json.dumps(r)) for r in records] and all(r["step"] == 2 for r in written)


def test_the_loop_with_workers_trains_on_the_same_batch():
    inline = make_loop([(wr.count_w7, 1.0)])
    pooled = make_loop([(wr.count_w7, 1.0)], reward_workers=2)
    try:
        a, metrics_a = inline.next_batch(trainer_version=0)
        b, metrics_b = pooled.next_batch(trainer_version=0)
        assert [(s.completion_ids, s.reward, s.advantage) for s in a] == \
            [(s.completion_ids, s.reward, s.advantage) for s in b]
        assert metrics_b["rollout/engine_steps"] >= metrics_a["rollout/engine_steps"]
        assert pooled.scorer.workers.broken is None and any(w is not None for w in pooled.scorer.workers.slots)
    finally:
        pooled.scorer.close()


def test_the_evaluation_scores_on_the_trainings_workers_and_counts_apart():
    from conftest import tiny_llama, tiny_tokenizer

    from unison.engine import Engine, EngineConfig
    from unison.rollout.loop import RolloutConfig
    from unison.train.evaluate import EvalConfig, Evaluator

    rows = [{"prompt": " ".join(f"w{3 + (i * 13 + j) % 250}" for j in range(5)), "answer": str(i)} for i in range(6)]
    rollout = RolloutConfig(group_size=2, samples_per_step=2, max_concurrent_rollouts=8, max_new_tokens=6)
    fns = [(wr.count_w7, 1.0), (wr.length, 0.5)]

    def evaluate(scorer=None):
        engine = Engine(tiny_llama(), EngineConfig(num_blocks=128, block_size=4, seed=0))
        evaluator = Evaluator(EvalConfig(steps=1, k=3), engine, tiny_tokenizer(), rows, fns, rollout, [2], None, 0,
                              scorer=scorer)
        return evaluator.run(lambda others: pytest.fail(f"no other requests are in flight, got {others}"))

    training = RewardScorer(fns, workers=2)
    try:
        apart = training.apart()
        apart._all_values = lambda call: pytest.fail("scored here, not on the workers")
        pooled = evaluate(apart)
        assert apart.workers is training.workers and training.workers.broken is None
        assert apart.scored == 6 * (1 + 3) and training.scored == 0  # counted apart from the training's
    finally:
        training.close()
    inline = evaluate()
    assert {k: v for k, v in pooled.items() if k != "eval/time_s"} == \
        {k: v for k, v in inline.items() if k != "eval/time_s"}
    assert inline["eval/reward_mean"] > 0


def guess(number: int) -> str:
    """Guess the number.

    Args:
        number: the guess
    """
    return "correct" if number == 6 else "higher" if number < 6 else "lower"


def test_episodes_with_tools_alone_score_in_the_workers_as_inline():
    from multiturn_helpers import ScriptedEngine, byte_tokenizer
    from test_environments import player, rows

    from unison.episodes import EpisodeConfig, MultiTurnRolloutLoop
    from unison.rollout.loop import RolloutConfig

    def rollout(workers: int, found=wr.found):
        tok = byte_tokenizer()
        cfg = RolloutConfig(group_size=4, samples_per_step=8, max_concurrent_rollouts=8, max_new_tokens=64,
                            reward_workers=workers)
        loop = MultiTurnRolloutLoop(ScriptedEngine(tok, player), tok, rows(), [(found, 1.0), (wr.pid, 0.0)], cfg,
                                    stop_token_ids=[257], max_sample_tokens=2048,
                                    episode_cfg=EpisodeConfig(max_turns=4), tools=[guess])
        behind = []  # before each engine step: the ended episodes' scorings not yet filed
        step = loop.engine.step
        loop.engine.step = lambda: behind.append(len(loop.scoring)) or step()
        try:
            batch, _ = loop.next_batch(trainer_version=0)
            return batch, loop.scorer.workers, max(behind)
        finally:
            loop.scorer.close()

    inline, _, behind_inline = rollout(0)
    pooled, workers, _ = rollout(2)
    assert workers is not None and workers.broken is None
    assert [(s.completion_ids, s.reward, s.advantage) for s in pooled] == \
        [(s.completion_ids, s.reward, s.advantage) for s in inline]
    assert len(pooled) == 8 and {s.shown["reward/pid"] for s in inline} == {os.getpid()}
    assert os.getpid() not in {s.shown["reward/pid"] for s in pooled}  # scored in the workers
    assert any(s.shown["turns"] > 1 for s in pooled)
    # A quarter second a call: the engine steps on while the workers score (inline: never a scoring outstanding)
    _, _, behind = rollout(2, wr.found_slowly)
    assert behind_inline == 0 and behind >= 1


def test_episodes_with_an_environment_score_here_where_the_environments_live():
    from test_environments import make_loop as episode_loop

    loop = episode_loop(reward_workers=2)  # solved/guessed pickle; the environments they read live in this process
    batch, _ = loop.next_batch(trainer_version=0)
    assert loop.scorer.workers is None and len(batch) == 4 and len({s.reward for s in batch}) > 1


def test_reward_worker_settings_are_checked_and_auto_is_for_gpus(caplog):
    from unison.config import ConfigError, load_config
    from unison.rollout.loop import AUTO_REWARD_WORKERS, RolloutConfig
    from unison.train.config import TrainConfig

    auto = RolloutConfig()
    assert auto.reward_workers == "auto" and auto.workers_for("cpu") == 0
    assert auto.workers_for("cuda:1") == AUTO_REWARD_WORKERS == 2
    assert RolloutConfig(reward_workers=3).workers_for("cpu") == 3
    assert load_config(TrainConfig, None, ["--rollout.reward_workers=4"]).rollout.reward_workers == 4
    assert load_config(TrainConfig, None, ["--rollout.reward_workers=auto"]).rollout.reward_workers == "auto"
    for bad in ("-1", "many", "1.5"):
        with pytest.raises(ConfigError, match="reward_workers"):
            load_config(TrainConfig, None, [f"--rollout.reward_workers={bad}"])
    with pytest.raises(ValueError, match="reward_timeout_s must be > 0"):
        RolloutConfig(reward_timeout_s=0)
    # "auto" on a GPU with functions that cannot travel: a note in the log, not a warning
    with caplog.at_level(logging.INFO):
        RewardScorer([(lambda prompts, completions, **_: [0.0] * len(completions), 1.0)], workers=2, asked=False)
    assert [r.levelname for r in caplog.records if "score inline" in r.message] == ["INFO"]
