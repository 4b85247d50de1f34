"""Data sets: conversational JSONL rows reach the engine rendered by the chat template; parquet and
``save_to_disk`` folders through ``datasets``; column names; held-out evaluation rows."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_llama, tiny_tokenizer

from unison.config import ConfigError, InputError, load_config
from unison.engine import Engine, EngineConfig
from unison.rollout.loop import RolloutConfig, RolloutLoop
from unison.tasks import DataConfig, load_task
from unison.train.config import TrainConfig

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w9{% endif %}")


def conversation(i: int) -> list[dict]:
    return [{"role": "w3", "content": f"w{10 + i} w11"}, {"role": "w4", "content": f"w{20 + i} w21 w22"}]


def test_conversational_jsonl_rows_reach_the_rollout_as_messages_through_the_chat_template(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"prompt": conversation(i), "solution": str(i), "level": i}) + "\n"
                            for i in range(4)))
    task = load_task(DataConfig(source=str(path), answer_column="solution"))
    assert [r["prompt"] for r in task.rows] == [conversation(i) for i in range(4)]
    assert [(r["answer"], r["solution"], r["level"]) for r in task.rows] == [(str(i), str(i), i) for i in range(4)]
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    seen = []

    def record(prompts, completions, solution, **_):
        seen.extend(zip(prompts, completions, solution, strict=True))
        return [float(len(c[0]["content"].split())) for c in completions]

    engine = Engine(tiny_llama(), EngineConfig(num_blocks=128, block_size=4, seed=0))
    loop = RolloutLoop(engine, tokenizer, task.rows, [(record, 1.0)], RolloutConfig(
        group_size=4, samples_per_step=4, max_concurrent_rollouts=8, max_new_tokens=8), stop_token_ids=[2])
    batch, _ = loop.next_batch(trainer_version=0)
    by_prompt = {tuple(m["content"] for m in p): s for p, _, s in seen}
    for sample in batch:
        text = tokenizer.decode(sample.prompt_ids)
        i = int(text.split()[1][1:]) - 10  # "w3 w1i w11 w4 w2i w21 w22 w9": the template's rendering
        assert text == f"w3 w{10 + i} w11 w4 w{20 + i} w21 w22 w9"
        assert by_prompt[(f"w{10 + i} w11", f"w{20 + i} w21 w22")] == str(i)
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for _, c, _ in seen)


def test_parquet_and_dataset_folders_through_datasets_with_named_columns(tmp_path):
    import datasets  # the `test` extra installs it

    rows = [{"question": f"What is {i} + 1?", "gold": str(i + 1), "source": "synthetic"} for i in range(6)]
    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    task = load_task(DataConfig(source=str(parquet), prompt_column="question", answer_column="gold"))
    assert [(r["prompt"], r["answer"], r["source"]) for r in task.rows] == \
           [(f"What is {i} + 1?", str(i + 1), "synthetic") for i in range(6)]
    assert task.eval_rows == []
    # A save_to_disk folder with two splits: train on one, evaluate on the other.
    folder = tmp_path / "ds"
    chats = [{"prompt": conversation(i), "answer": str(i)} for i in range(3)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]), "test": datasets.Dataset.from_list(
        [{"question": "held out?", "gold": "7", "source": "x"}])}).save_to_disk(str(folder))
    task = load_task(DataConfig(source=str(folder), prompt_column="question", answer_column="gold",
                                eval_split="test"))
    assert len(task.rows) == 4 and [(r["prompt"], r["answer"]) for r in task.eval_rows] == [("held out?", "7")]
    chat_parquet = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(chats).to_parquet(str(chat_parquet))
    assert [r["prompt"] for r in load_task(DataConfig(source=str(chat_parquet))).rows] == [c["prompt"] for c in chats]
    with pytest.raises(InputError, match=r"no split 'validation'.*\['test', 'train'\]"):
        load_task(DataConfig(source=str(folder), prompt_column="question", answer_column="gold",
                             eval_split="validation"))
    with pytest.raises(InputError, match=r"no row with a prompt \(column 'prompt'\).*columns: \['gold', 'question'"):
        load_task(DataConfig(source=str(parquet)))


def test_held_out_rows_by_fraction_or_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    task = load_task(DataConfig(source=str(path), eval_split=0.2))
    train, held = {r["prompt"] for r in task.rows}, {r["prompt"] for r in task.eval_rows}
    assert len(train) == 8 and len(held) == 2 and not train & held
    assert held == {r["prompt"] for r in load_task(DataConfig(source=str(path), eval_split=0.2)).eval_rows}
    other = tmp_path / "eval.jsonl"
    other.write_text(json.dumps({"prompt": "e", "answer": "1"}) + "\n")
    task = load_task(DataConfig(source=str(path), eval_source=str(other)))
    assert len(task.rows) == 10 and task.eval_rows == [{"prompt": "e", "answer": "1"}]
    # reasoning-gym tasks hold out a fraction of their generated rows too
    assert len(load_task(DataConfig(size=10, eval_split=0.3)).eval_rows) == 3
    with pytest.raises(InputError, match="has one split"):
        load_task(DataConfig(source=str(path), eval_split="test"))
    with pytest.raises(ConfigError, match=r"data: eval_split must be a split name or a fraction in \(0, 1\)"):
        load_config(TrainConfig, None, ["--data.eval_split=1.5"])
    assert load_config(TrainConfig, None, ["--data.eval_split=test"]).data.eval_split == "test"
    assert load_config(TrainConfig, None, ["--data.eval_split=0.1"]).data.eval_split == 0.1
