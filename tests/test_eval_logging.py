"""Evaluation during training, completion logs, trackers and checkpoint retention, through `unison train`'s own
entry point on a tiny model."""

from __future__ import annotations

import json
import os

import pytest
from conftest import tiny_llama, tiny_tokenizer

from unison.config import load_config
from unison.engine import Engine, EngineConfig, SamplingParams
from unison.metrics import _panel_keys
from unison.rollout.loop import RolloutConfig, encode_prompt
from unison.train.config import TrainConfig
from unison.train.evaluate import EvalConfig, Evaluator
from unison.train.loop import train


def has_w7(completions, **kwargs):
    """TRL-style (keywords only). >= 1 (correct) where the completion holds w7; its length breaks ties."""
    return [float("w7" in c.split()) + 0.01 * len(c.split()) for c in completions]


def data_file(path, n=12):
    path.write_text("".join(json.dumps({"prompt": " ".join(f"w{3 + (i * 11 + j) % 250}" for j in range(4 + i % 5)),
                                        "answer": "w7"}) + "\n" for i in range(n)))
    return str(path)


def low_first_word(text: str) -> bool:
    """About one sample in four of the random tiny model: its first word is w3 ... w59."""
    words = text.split()
    return bool(words) and int(words[0][1:]) < 60


def test_pass_at_k_and_mean_at_k_count_the_sampled_completions():
    seen = []

    def judge(prompts, completions, **_):
        seen.extend(zip(prompts, completions, strict=True))
        return [float(low_first_word(c)) for c in completions]

    rows = [{"prompt": " ".join(f"w{3 + (i * 13 + j) % 250}" for j in range(5)), "answer": "x"} for i in range(6)]
    engine, tokenizer = Engine(tiny_llama(), EngineConfig(num_blocks=128, block_size=4, seed=0)), tiny_tokenizer()
    rollout = RolloutConfig(group_size=2, samples_per_step=2, max_concurrent_rollouts=8, max_new_tokens=4)
    evaluator = Evaluator(EvalConfig(steps=1, k=4), engine, tokenizer, rows, [(judge, 1.0)], rollout, [2], None, 0)
    metrics = evaluator.run(lambda others: pytest.fail(f"no other requests are in flight, got {others}"))
    for row in rows:  # greedy decoding is deterministic: the same completions from plain requests, all at once
        engine.submit(encode_prompt(tokenizer, row["prompt"]),
                      SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=[2]))
    done = []
    while len(done) < len(rows):
        done += engine.step()
    by_group = {c.group_id: c for c in done}
    greedy = {row["prompt"]: tokenizer.decode(by_group[f"g{len(rows) * 2 + i}"].token_ids, skip_special_tokens=True)
              for i, row in enumerate(rows)}  # the evaluator's requests were groups 0 .. 2 * len(rows) - 1
    assert len(seen) == 6 * (1 + 4)
    by_prompt: dict[str, list[str]] = {}
    for prompt, completion in seen:
        by_prompt.setdefault(prompt, []).append(completion)
    greedy_ok, any_ok, frac_ok = [], [], []
    for prompt, completions in by_prompt.items():
        assert greedy[prompt] in completions
        sampled = list(completions)
        sampled.remove(greedy[prompt])
        greedy_ok.append(low_first_word(greedy[prompt]))
        any_ok.append(any(map(low_first_word, sampled)))
        frac_ok.append(sum(map(low_first_word, sampled)) / 4)
    assert metrics["eval/greedy_accuracy"] == pytest.approx(sum(greedy_ok) / 6)
    assert metrics["eval/pass@4"] == pytest.approx(sum(any_ok) / 6)
    assert metrics["eval/mean@4"] == pytest.approx(sum(frac_ok) / 6)
    assert 0 < metrics["eval/mean@4"] < metrics["eval/pass@4"]


def test_eval_completions_wandb_and_save_total_limit_in_a_real_run(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    cfg = load_config(TrainConfig, None, [
        f"--output_dir={out}", f"--model.name_or_path={model_dir}", "--max_steps=3", "--rollout.group_size=4",
        "--rollout.samples_per_step=8", "--rollout.max_concurrent_rollouts=16", "--rollout.max_new_tokens=8",
        "--engine.num_blocks=256", "--engine.block_size=8", "--step.max_tokens_per_row=64", "--optim.lr=0.0",
        f"--data.source={data_file(tmp_path / 'rows.jsonl')}", "--data.eval_split=0.25",
        "--rewards=[{fn: 'test_eval_logging:has_w7'}]", "--eval.steps=2", "--eval.k=2",
        "--log.completions_every=1", "--log.completions_per_log=4", "--log.report_to=[tensorboard, wandb]",
        "--save_every=1", "--save_total_limit=1", "--rollout.reward_workers=1"])  # scored in a worker process
    train(cfg)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert "eval/greedy_accuracy" not in records[0]
    for r in records[1:]:  # evaluated at step 2 and after the last step
        assert r["eval/prompts"] == 3.0 and r["eval/reward_failed"] == 0
        assert 0 <= r["eval/mean@2"] <= r["eval/pass@2"] <= 1 and 0 <= r["eval/greedy_accuracy"] <= 1
    # lr 0: the same weights and the same seeds at both evaluations, in between training rollouts or not
    assert {k: v for k, v in records[1].items() if k.startswith("eval/") and k != "eval/time_s"} == \
           {k: v for k, v in records[2].items() if k.startswith("eval/") and k != "eval/time_s"}
    assert all(r["reward/has_w7"] is not None for r in records)  # the config's reward function scored the run
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1] * 4 + [2] * 4 + [3] * 4  # the batch each step trained on
    for step in (1, 2, 3):  # two groups of 4: two of each shown, advantages standardised within a group
        assert len({r["prompt"] for r in logged if r["step"] == step}) == 2
    for r in logged:
        assert isinstance(r["prompt"], str) and isinstance(r["completion"], str) and r["answer"] == "w7"
        assert r["reward"] == pytest.approx(r["reward/has_w7"]) and abs(r["advantage"]) > 0
        assert r["reward/has_w7"] == pytest.approx(has_w7([r["completion"]])[0])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out)).Reload()
    assert "completions/text_summary" in events.Tags()["tensors"] and "eval/pass@2" in events.Tags()["scalars"]
    assert {"eval/greedy_accuracy", "eval/pass@2", "eval/mean@2"} <= set(_panel_keys(records))  # in curves.png
    assert (out / "curves.png").stat().st_size > 1000
    runs = [d for d in os.listdir(out / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 1 and any(f.endswith(".wandb") for f in os.listdir(out / "wandb" / runs[0]))
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint")) == ["checkpoint", "checkpoint-2"]


def test_report_to_choices_and_missing_trackers_are_clear_errors(tmp_path):
    import importlib.util

    from unison.config import ConfigError
    from unison.train.reporting import LogConfig, build_trackers

    with pytest.raises(ConfigError, match=r"'log.report_to\[0\]' must be one of"):
        load_config(TrainConfig, None, ["--log.report_to=[tensorbord]"])
    with pytest.raises(ConfigError, match="'none' cannot be combined"):
        load_config(TrainConfig, None, ["--log.report_to=[none, wandb]"])
    with pytest.raises(ConfigError, match="'tensorboard' is now log.report_to"):
        load_config(TrainConfig, None, ["--tensorboard=false"])
    assert not load_config(TrainConfig, None, ["--log.report_to=[]"]).log.tensorboard
    assert load_config(TrainConfig).log.report_to == ["tensorboard"]  # the default run's behaviour
    if importlib.util.find_spec("trackio") is None:
        with pytest.raises(ImportError, match=r"names trackio, which is not installed: `pip install trackio`"):
            build_trackers(LogConfig(report_to=["trackio"]), str(tmp_path), {}, resume=False)
