"""Datasets and reward functions: what the policy is asked, and how its answers are scored.

``load_task(DataConfig(source=...))`` takes a reasoning-gym task name (generated, no download), a data file whose
rows have a prompt and an answer column (.jsonl, .json, .csv; .parquet or a ``datasets`` folder where the
``datasets`` package is installed) or a Hub data set id, or a built-in task (multi-turn: ``sum_feedback``,
``guess_number``; with images: ``count_shapes``). A prompt is a string (the user message) or a conversation (a list
of ``{"role", "content"}`` messages); rows may carry images (``unison.tasks.image_rows``); ``DataConfig.eval_split``
/ ``eval_source`` give held-out rows.

>>> task = load_task(DataConfig(size=4))
>>> sorted(task.rows[0])[:3], len(task.reward_fns)
(['answer', 'metadata', 'prompt'], 3)
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import random
from collections.abc import Iterable
from pathlib import Path

from unison.config import InvalidInputError, MissingInputError
from unison.tasks.image_rows import has_images, with_images
from unison.tasks.rewards import FormatReward, MathReward, RewardFn, combine
from unison.tasks.task import DEFAULT_TASK, DataConfig, Task
from unison.vision.messages import is_part_list

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_TASK", "DataConfig", "Task", "chat_prompt", "combine", "load_rows", "load_task"]


def load_task(cfg: DataConfig) -> Task:
    from unison.tasks.multiturn import MULTI_TURN_TASKS
    from unison.tasks.visual import VISUAL_TASKS

    if cfg.source in MULTI_TURN_TASKS:
        task = MULTI_TURN_TASKS[cfg.source](cfg)
    elif cfg.source in VISUAL_TASKS:
        task = VISUAL_TASKS[cfg.source](cfg)
    elif _is_gym_name(cfg.source):
        from unison.tasks.gym import gym_task

        task = gym_task(cfg)
    else:
        rows = load_rows(cfg.source, cfg.prompt_column, cfg.answer_column, cfg.split, cfg.subset)
        # math-verify judges numbers, fractions and LaTeX alike; a non-math answer falls back to equality.
        fns: list[tuple[RewardFn, float]] = [(MathReward(), 1.0), (FormatReward(), 0.1)]
        task = Task(Path(cfg.source).name, rows, fns, cfg.system_prompt)
    rows, eval_rows = _held_out(cfg, task.rows)
    return dataclasses.replace(task, rows=rows, eval_rows=eval_rows)


def _is_gym_name(source: str) -> bool:
    path = Path(source).expanduser()
    return not (path.exists() or path.suffix or "/" in source)  # reasoning-gym names have neither


def _held_out(cfg: DataConfig, rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training rows, evaluation rows) as ``cfg.eval_split`` / ``cfg.eval_source`` say."""
    if cfg.eval_source:
        return rows, load_rows(cfg.eval_source, cfg.prompt_column, cfg.answer_column, cfg.split, cfg.subset)
    if cfg.eval_split is None:
        return rows, []
    if isinstance(cfg.eval_split, float):
        n = round(cfg.eval_split * len(rows))
        if not 0 < n < len(rows):
            raise InvalidInputError(f"data.eval_split={cfg.eval_split} of {len(rows)} rows holds out {n}: it must "
                                    "leave at least one row to evaluate on and one to train on")
        order = list(range(len(rows)))
        random.Random(f"{cfg.seed}/eval_split").shuffle(order)
        held = set(order[:n])
        return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]
    path = Path(cfg.source).expanduser()
    if _is_gym_name(cfg.source) or (path.is_file()):
        raise InvalidInputError(f"data.eval_split={cfg.eval_split!r}: {cfg.source} has one split; hold out a "
                                "fraction (data.eval_split=0.1) or name another file (data.eval_source)")
    return rows, load_rows(cfg.source, cfg.prompt_column, cfg.answer_column, cfg.eval_split, cfg.subset)


def chat_prompt(tokenizer, prompt: str, system_prompt: str | None = None) -> str:
    """The prompt as the model sees it: chat template applied, assistant turn opened."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": prompt})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def load_rows(source: str | Path, prompt_column: str = "prompt", answer_column: str = "answer",
              split: str | None = None, subset: str | None = None) -> list[dict]:
    """Rows of a data file, ``datasets`` folder or Hub data set with a prompt and (unless ``answer_column`` is "")
    an answer; rows missing either are skipped with a warning. Each row keeps its columns and gets ``prompt`` (a
    string, or a list of messages) and ``answer`` (a string) from the named ones.

    Raises ``MissingInputError`` (a FileNotFoundError) for a missing path and ``InvalidInputError`` (a ValueError)
    for a file that does not decode or parse, or has no usable row; the message names the file and line.
    """
    path = Path(source).expanduser()
    if path.exists():
        reader = _READERS.get(path.suffix) if path.is_file() else None
        raw = reader(path) if reader is not None else _hf().read_local(path, split)
    elif isinstance(source, str) and "/" in source and not path.suffix and source[0] not in "./~":
        raw = _hf().read_hub(source, subset, split or "train")
    else:
        raise MissingInputError(f"data file {path} does not exist")
    base_dir = (path if path.is_dir() else path.parent) if path.exists() else None  # relative image paths
    rows, bad, seen_columns, image_error = [], [], None, ""
    for index, row in enumerate(raw):
        if seen_columns is None and isinstance(row, dict):
            seen_columns = sorted(row)
        try:
            usable = _usable_row(row, prompt_column, answer_column, base_dir)
        except InvalidInputError as e:  # an image that does not load; image parts that do not match the images
            usable, image_error = None, image_error or f" (first: index {index}, {e})"
        if usable is None:
            bad.append(index)
        else:
            rows.append(usable)
    columns = f"a prompt (column {prompt_column!r})" + (f" and an answer ({answer_column!r})" if answer_column else "")
    unusable = columns.replace(" and ", " or ") + (f", or with unusable images{image_error}" if image_error else "")
    if bad:
        log.warning("%s: skipped %d row(s) without %s, at index %s", source, len(bad), unusable,
                    ", ".join(map(str, bad[:20])) + (" ..." if len(bad) > 20 else ""))
    if not rows:
        what = "is empty" if not bad else f"has no row with {columns} ({len(bad)} skipped{image_error})"
        if seen_columns is not None:
            what += f"; its columns: {seen_columns} (data.prompt_column and data.answer_column name them)"
        raise InvalidInputError(f"data file {source} {what}")
    return rows


def _hf():
    from unison.tasks import hf

    return hf


def _usable_row(row, prompt_column: str, answer_column: str, base_dir: Path | None = None) -> dict | None:
    """The row as ``load_rows`` keeps it, or None; ``InvalidInputError`` for images that do not load."""
    if not isinstance(row, dict):
        return None
    prompt, answer = row.get(prompt_column), row.get(answer_column) if answer_column else None
    if _text(prompt):
        prompt = str(prompt)
    elif _is_conversation(prompt):
        prompt = [dict(m) for m in prompt]
    else:
        return None
    if answer_column and answer in (None, ""):
        return None
    out = {**row, "prompt": prompt}
    if answer_column:
        out["answer"] = str(answer)
    if has_images(out, prompt):
        out = with_images(out, base_dir)
    return out


def _is_conversation(value) -> bool:
    """A list of ``{"role": str, "content": str | parts}`` messages (TRL's conversational prompt; parts: ``{"type":
    "text", "text": str}`` and ``{"type": "image"}``, its vision-language form)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str)
        and (isinstance(m.get("content"), str) or is_part_list(m.get("content"))) for m in value)


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


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv}
