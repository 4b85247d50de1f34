"""Resuming a run: the trainer state a checkpoint holds, checked against the run that continues from it.

Each trainer state records the run that saved it (``run_record``: its configuration, number of processes and data
set). A resumed run names every setting that changed in a warning and goes on where that is safe (lr, max_steps,
group_size, ...); it stops with an ``InputError`` where the state cannot be used: another ``dist.tp`` or number of
processes, as each rank holds its own shard of the optimizer state. Another data set starts a fresh pass over its
rows: the saved data order indexes the old ones (it used to stop the run with an IndexError).
"""

from __future__ import annotations

import hashlib
import logging
import random
from typing import Any

import torch

from ..config import InputError, config_to_dict, format_value
from ..vision.images import image_digest
from .checkpoint import load_trainer_state
from .config import TrainConfig

log = logging.getLogger(__name__)

# Differ on most resumes by design: a warning would be noise.
_EXPECTED_TO_DIFFER = frozenset({"resume", "output_dir", "overwrite"})
# The optimizer state is sharded along these: a run that changes them cannot load it.
_FIXED = frozenset({"dist.tp"})
_ABSENT = object()  # a setting one of the two configurations does not have


def run_record(cfg: TrainConfig, world_size: int, rows: list[dict]) -> dict:
    """What each trainer state records about its run, for ``load_resume_state`` to check against."""
    return {"config": config_to_dict(cfg), "world_size": world_size, "data": data_fingerprint(rows)}


def data_fingerprint(rows: list[dict]) -> dict:
    """The data set's size and a hash of its prompts (and their images' pixels) in order: what the saved data order
    (row indices) refers to."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(str(row.get("prompt", "")).encode())
        for image in row.get("images") or ():
            digest.update(image_digest(image))
        digest.update(b"\0")
    return {"rows": len(rows), "prompts_sha256": digest.hexdigest()}


def load_resume_state(cfg: TrainConfig, rank: int, world_size: int) -> dict:
    """This rank's trainer state in ``cfg.resume``, checked against this run before anything heavy loads."""
    saved = load_trainer_state(cfg.resume, rank)
    if "config" not in saved:
        log.warning("%s was saved before checkpoints recorded their run's settings: nothing can be checked against "
                    "this run's (number of processes, dist.tp, data set)", cfg.resume)
    else:
        check_resumable(saved, cfg, world_size)
    log.info("resuming from %s at step %d", cfg.resume, saved["step"] + 1)
    return saved


def check_resumable(saved: dict, cfg: TrainConfig, world_size: int) -> None:
    """Raise ``InputError`` where this run cannot continue ``saved``; warn about every other changed setting."""
    fresh_start = f"or start a new run from its weights with --model.name_or_path={cfg.resume} and no --resume"
    if saved["world_size"] != world_size:
        raise InputError(f"{cfg.resume} was saved by {saved['world_size']} processes and this run has {world_size}: "
                         f"each process's trainer state holds its own shard of the optimizer state. Resume with "
                         f"{saved['world_size']} processes (torchrun --nproc-per-node), {fresh_start}")
    changes = [c for c in config_changes(saved["config"], config_to_dict(cfg)) if c[0] not in _EXPECTED_TO_DIFFER]
    fixed = [_show(c) for c in changes if c[0] in _FIXED]
    if fixed:
        raise InputError(f"{cfg.resume} cannot continue with {'; '.join(fixed)}: the optimizer state is sharded "
                         f"along it. Resume with the checkpoint's setting, {fresh_start}")
    if changes:
        log.warning("resuming %s with other settings than it was saved with: %s", cfg.resume,
                    "; ".join(map(_show, changes)))


def config_changes(old: dict, new: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(dotted key, saved value, new value)`` for each setting that differs between two ``config_to_dict``
    trees; a key that only one of them has (another unison version) is ``_ABSENT`` in the other."""
    changes = []
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key, _ABSENT), new.get(key, _ABSENT)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append((prefix + key, a, b))
    return changes


def _show(change: tuple[str, Any, Any]) -> str:
    key, a, b = change
    return f"{key}: {_value(a)} -> {_value(b)}"


def _value(value: Any) -> str:
    return "(not set)" if value is _ABSENT else format_value(value)


def restore(saved: dict, optimizer, rollout, data: dict) -> int:
    """Load ``saved`` into this run's optimizer, rollout loop and RNGs; returns the step it was saved at. ``data``:
    this run's ``data_fingerprint``."""
    optimizer.load_state_dict(saved["optimizer"])
    rollout.load_state_dict(_rollout_state(saved, data))
    random.setstate(saved["python_rng"])
    torch.set_rng_state(saved["torch_rng"])
    return saved["step"]


def _rollout_state(saved: dict, data: dict) -> dict:
    """The saved rollout state, without its data order where the rows differ from the ones that order indexes."""
    state, was = saved["rollout"], saved.get("data")
    changed = was != data if was is not None else any(i >= data["rows"] for i in state["order"])
    if not changed:
        return state
    before = f"{was['rows']} rows" if was is not None else "more rows"
    other = ", other prompts" if was is not None and was["rows"] == data["rows"] else ""
    log.warning("the data set is not the one the checkpoint was saved with (%s -> %d rows%s): the saved data order "
                "does not apply to it; starting a fresh pass over the new rows", before, data["rows"], other)
    return {**state, "order": []}
