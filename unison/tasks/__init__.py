"""Datasets and reward functions: what the policy is asked, and how its answers are scored.

``load_task(DataConfig(source=...))`` takes a reasoning-gym task name (generated, no download) or a
data file whose rows have ``prompt`` and ``answer`` (.jsonl, .json, .csv; .parquet or a ``datasets``
folder where the ``datasets`` package is installed).

>>> task = load_task(DataConfig(size=4))
>>> sorted(task.rows[0])[:3], len(task.reward_fns)
(['answer', 'metadata', 'prompt'], 3)
"""

from __future__ import annotations

import csv
import io
import json
import logging
from collections.abc import Iterable
from pathlib import Path

from unison.config import InvalidInputError, MissingInputError
from unison.tasks.rewards import FormatReward, MathReward, RewardFn, combine
from unison.tasks.task import DEFAULT_TASK, DataConfig, Task

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_TASK", "DataConfig", "Task", "chat_prompt", "combine", "load_rows", "load_task"]


def load_task(cfg: DataConfig) -> Task:
    path = Path(cfg.source).expanduser()
    if path.exists() or path.suffix or "/" in cfg.source:  # reasoning-gym names have neither
        rows = load_rows(path)
        # math-verify judges numbers, fractions and LaTeX alike; a non-math answer falls back to equality.
        fns: list[tuple[RewardFn, float]] = [(MathReward(), 1.0), (FormatReward(), 0.1)]
        return Task(path.name, rows, fns, cfg.system_prompt)
    from unison.tasks.gym import gym_task

    return gym_task(cfg)


def chat_prompt(tokenizer, prompt: str, system_prompt: str | None = None) -> str:
    """The prompt as the model sees it: chat template applied, assistant turn opened."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a data file with ``prompt`` and ``answer``; rows missing either are skipped with a warning.

    Raises ``MissingInputError`` (a FileNotFoundError) for a missing path and ``InvalidInputError`` (a ValueError)
    for a file that does not decode or parse, or has no usable row; the message names the file and line.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise MissingInputError(f"data file {path} does not exist")
    reader = _READERS.get(path.suffix, _read_datasets)
    rows, bad = [], []
    for index, row in enumerate(reader(path)):
        if not isinstance(row, dict) or not _text(row.get("prompt")) or row.get("answer") in (None, ""):
            bad.append(index)
            continue
        rows.append({**row, "prompt": str(row["prompt"]), "answer": str(row["answer"])})
    if bad:
        log.warning("%s: skipped %d row(s) without a prompt or an answer, at index %s", path, len(bad),
                    ", ".join(map(str, bad[:20])) + (" ..." if len(bad) > 20 else ""))
    if not rows:
        what = "is empty" if not bad else f"has no row with a prompt and an answer ({len(bad)} skipped)"
        raise InvalidInputError(f"data file {path} {what}")
    return rows


def _text(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _read_text(path: Path) -> str:
    """The file as text; a byte that is not UTF-8 is an error naming its line (a BOM, as Excel writes, is dropped)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise InvalidInputError(f"{path}:{line}: not UTF-8 ({e.reason} at byte {e.start}): save the file as UTF-8, "
                                "e.g. `iconv -f latin1 -t utf-8`") from None


def _read_jsonl(path: Path) -> Iterable[dict | None]:
    for line_no, line in enumerate(_read_text(path).split("\n"), 1):  # not splitlines: JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as e:
            log.warning("%s:%d: not JSON (%s)", path, line_no, e.msg)
            yield None


def _read_json(path: Path) -> Iterable[dict]:
    try:
        data = json.loads(_read_text(path) or "[]")
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"{path}:{e.lineno}: not JSON ({e.msg}, column {e.colno})") from None
    if isinstance(data, dict):  # {"rows": [...]} or {"data": [...]} style
        data = next((v for v in data.values() if isinstance(v, list)), [data])
    return data


def _read_csv(path: Path) -> Iterable[dict]:
    return csv.DictReader(io.StringIO(_read_text(path), newline=""))


def _read_datasets(path: Path) -> Iterable[dict]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path}: reading {path.suffix or 'a folder'} needs `pip install datasets`; "
                         f"or give a .jsonl, .json or .csv file") from None
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    else:
        ds = datasets.load_dataset(path.suffix.lstrip("."), data_files=str(path), split="train")
    return iter(ds)


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}
