"""Tasks: data files, reasoning-gym rows, answer extraction and reward functions."""

from __future__ import annotations

import json
import logging

import pytest

from unison.config import InputError
from unison.tasks import DataConfig, load_rows, load_task
from unison.tasks.rewards import (
    ClosenessReward,
    ExactAnswerReward,
    FormatReward,
    MathReward,
    combine,
    extract_answer,
    last_boxed,
    to_number,
)


@pytest.mark.parametrize("completion, expected", [
    ("<answer>7</answer>", "7"),
    ("first <answer>3</answer> then <answer> 12 </answer>", "12"),
    ("The sum is <answer>**-4.**</answer>", "-4"),
    ("3 + 4 = 7\n<answer>7", "7"),  # closing tag never came: the last number
    ("I made the final answer in <answer> tags.", None),
    ("The answer is 6 + 10 = 16.", "16"),
    ('The answer to this question is "yerk"', "yerk"),
    ("so \\boxed{\\frac{1}{2}} it is", "\\frac{1}{2}"),
    ("The answer is 12 apples.", "12"),
    ("Answer: 1,024", "1,024"),
    ("The final answer is: **8**", "8"),
    ("5 + 2 = 7", "7"),  # no marker: the last number
    ("<answer>nus</answer>", "nus"),
    ("I do not know", None),
    ("", None),
])
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{1} and \\boxed{\\sqrt{2}}") == "\\sqrt{2}"
    assert last_boxed("\\boxed{unclosed") is None
    assert to_number("−3") == -3.0 and to_number("+1,000.") == 1000.0 and to_number("7 apples") is None


def test_format_reward():
    fmt = FormatReward()
    assert fmt([""] * 5, ["<answer>5</answer>", "x <answer>5</answer>\n", "<answer>5</answer> because",
                          "<answer></answer>", "5"]) == [1.0, 1.0, 0.5, 0.0, 0.0]


def test_closeness_and_exact_rewards():
    close = ClosenessReward()
    got = close(["q"] * 4, ["<answer>7</answer>", "<answer>8</answer>", "no idea", "<answer>abc</answer>"],
                answer=["7", "7", "7", "cba"])
    assert got[0] == 1.0 and 0.3 < got[1] < 0.4 and got[2] == 0.0 and got[3] is None
    exact = ExactAnswerReward()
    assert exact(["q"] * 3, ["<answer>7.0</answer>", "it is 8", "<answer>NUS</answer>"],
                 answer=["7", "7", "nus"]) == [1.0, 0.0, 1.0]


def test_combine_skips_rewards_that_do_not_apply():
    fns = [(ExactAnswerReward(), 1.0), (FormatReward(), 0.2), (ClosenessReward(), 0.3)]
    total = combine(fns, ["q", "q"], ["<answer>cba</answer>", "<answer>8</answer>"], answer=["cba", "7"])
    assert total[0] == pytest.approx(1.2)  # closeness is None for a word answer
    assert total[1] == pytest.approx(0.2 + 0.3 * 0.36788, abs=1e-4)
    with pytest.raises(ValueError, match="returned 1 rewards for 2"):
        combine([(lambda p, c, **k: [1.0], 1.0)], ["q", "q"], ["a", "b"])


def test_math_reward_with_math_verify():
    math = MathReward()
    completions = ["so the answer is \\boxed{\\frac{1}{2}}", "<answer>0.5</answer>", "<answer>72</answer>",
                   "He has 71 clips.", "<answer>\\sqrt{2}</answer>", "<answer>Paris</answer>", "<answer>Rome</answer>"]
    answers = ["0.5", "\\frac{1}{2}", "72", "72", "\\sqrt{2}", "Paris", "Paris"]
    assert math(["q"] * 7, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]


def test_jsonl_bad_rows_are_counted_and_skipped(tmp_path, caplog):
    path = tmp_path / "math.jsonl"
    lines = [{"prompt": "1+1?", "answer": "2"}, {"question": "no prompt", "answer": "3"},
             {"prompt": "  ", "answer": "1"}, {"prompt": "no answer"}, {"prompt": "2*3?", "answer": 6, "id": 9}]
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n{not json\n"
                    + "\n".join(json.dumps(x) for x in lines[2:]) + "\n")
    with caplog.at_level(logging.WARNING):
        task = load_task(DataConfig(source=str(path)))
    assert [r["prompt"] for r in task.rows] == ["1+1?", "2*3?"]
    assert task.rows[1] == {"prompt": "2*3?", "answer": "6", "id": 9}
    assert "skipped 4 row(s)" in caplog.text and "index 1, 2, 3, 4" in caplog.text
    assert "math.jsonl:3: not JSON" in caplog.text
    assert task.score(["<answer>2</answer>", "6"], task.rows) == [pytest.approx(1.1), 1.0]


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl is empty"):
        load_task(DataConfig(source=str(empty)))
    no_prompts = tmp_path / "bad.json"
    no_prompts.write_text(json.dumps([{"question": "x", "answer": "1"}]))
    with pytest.raises(ValueError, match="bad.json has no row with a prompt"):
        load_rows(no_prompts)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_task(DataConfig(source=str(tmp_path / "missing.jsonl")))


def test_unreadable_data_files_are_input_errors_naming_file_and_line(tmp_path):
    jsonl = tmp_path / "latin1.jsonl"
    jsonl.write_bytes(b'{"prompt": "1+1?", "answer": "2"}\n{"prompt": "caf\xe9?", "answer": "2"}\n')
    with pytest.raises(InputError, match=r"latin1.jsonl:2: not UTF-8"):
        load_rows(jsonl)
    table = tmp_path / "latin1.csv"
    table.write_bytes(b"prompt,answer\nCapital of France?,Paris\nCaf\xe9?,x\n")
    with pytest.raises(InputError, match=r"latin1.csv:3: not UTF-8"):
        load_task(DataConfig(source=str(table)))
    broken = tmp_path / "broken.json"
    broken.write_text('[{"prompt": "a", "answer": "1"},\n {"prompt": }]')
    with pytest.raises(InputError, match=r"broken.json:2: not JSON"):
        load_rows(broken)
    for missing in ("missing.jsonl", "missing.csv"):
        with pytest.raises(InputError, match=missing):
            load_task(DataConfig(source=str(tmp_path / missing)))


def test_csv_rows(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text("prompt,answer\nCapital of France?,Paris\n,x\n")
    assert load_rows(path) == [{"prompt": "Capital of France?", "answer": "Paris"}]


@pytest.mark.parametrize("source", ["basic_arithmetic", "chain_sum", "spell_backward", "leg_counting"])
def test_gym_rows_and_gold_answers_score_full(source):
    task = load_task(DataConfig(source=source, size=6, seed=3))
    assert len(task.rows) == 6
    for row in task.rows:
        assert row["prompt"].startswith(row["question"].strip()) and "<answer>" in row["prompt"]
        assert isinstance(row["answer"], str) and row["answer"]
    gold = [f"<answer>{r['answer']}</answer>" for r in task.rows]
    exact_fn = task.reward_fns[0][0]
    columns = {k: [r[k] for r in task.rows] for k in ("answer", "question", "metadata")}
    assert exact_fn([r["prompt"] for r in task.rows], gold, **columns) == [1.0] * 6
    wrong = task.score(["<answer>#</answer>"] * 6, task.rows)
    assert all(w == pytest.approx(0.2) for w in wrong)  # format credit only
    assert min(task.score(gold, task.rows)) >= 1.2


def test_default_task_is_one_digit_sums():
    task = load_task(DataConfig(size=30))
    assert task.name == "chain_sum"
    ops = set()
    for row in task.rows:
        a, op, b = row["question"].split(": ")[1].rstrip(" =").split(" ")
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        ops.add(op)
    assert ops == {"+", "-"}


def test_numeric_answers_get_no_substring_credit():
    task = load_task(DataConfig(source="basic_arithmetic", size=30, seed=1))
    row = next(r for r in task.rows if len(r["answer"]) == 1 and r["answer"] != "0")
    exact = task.reward_fns[0][0]
    columns = {k: [row[k]] for k in ("answer", "question", "metadata")}
    assert exact.score("1" + row["answer"], row) > 0  # reasoning-gym's own scorer: substring credit
    assert exact([row["prompt"]], [f"<answer>1{row['answer']}</answer>"], **columns) == [0.0]
    assert exact([row["prompt"]], ["<answer>0123456789</answer>"], **columns) == [0.0]


def test_gym_config_errors():
    with pytest.raises(ValueError, match="not_a_task"):
        load_task(DataConfig(source="not_a_task"))
    with pytest.raises(ValueError, match="max_digitz"):
        load_task(DataConfig(source="chain_sum", gym={"max_digitz": 2}))
