"""The run directory (``output_dir``): a run never silently overwrites another's, and starts clean.

A folder holds a previous run when it holds what unison writes there: config.yaml, metrics.jsonl (and the
``metrics.prev-N.jsonl`` of older runs), TensorBoard events, curves.png, ``checkpoint`` and ``checkpoint-N``. A new
run into it is refused unless it resumes (``resume``: the metrics are appended to) or ``overwrite`` asks for those
outputs to be deleted first; no other file is ever touched. What a save killed midway left there is cleared at
the next start.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import re
import shutil

import torch.distributed as dist

from ..config import InputError, InvalidInputError, config_to_dict, dump_config
from ..metrics import CURVES_FILE, METRICS_FILE, PREVIOUS_METRICS_FILES, MetricsWriter
from .checkpoint import SET_ASIDE, TRAINER_STATE_TMP_PREFIX
from .config import TrainConfig
from .reporting import COMPLETIONS_FILE, build_trackers

log = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
_OUTPUT_FILES = (CONFIG_FILE, METRICS_FILE, PREVIOUS_METRICS_FILES, CURVES_FILE, f"{CURVES_FILE}.tmp.png",
                 "events.out.tfevents.*", COMPLETIONS_FILE)
_CHECKPOINT = re.compile(r"checkpoint(-(\d+))?$")
_LEFTOVER = re.compile(r"\.(checkpoint(?:-\d+)?)\.(tmp|old)-.+$")  # see unison.train.checkpoint


def check_run_dir(cfg: TrainConfig, main: bool, scaled_out: bool) -> None:
    """Refuse an ``output_dir`` this run cannot use, then (rank 0) clear what a killed save left there. Every rank
    checks, before the model loads: they all fail at once, not one while the others wait for it."""
    check_output_dir(cfg.output_dir, cfg.resume, cfg.overwrite)
    if scaled_out:
        dist.barrier()  # every rank has looked before rank 0 changes anything
    if main:
        clear_leftovers(cfg.output_dir)


def check_output_dir(output_dir: str, resume: str = "", overwrite: bool = False) -> None:
    """Raise ``InputError`` for an ``output_dir`` that is a file, or that holds a previous run that neither
    ``resume`` nor ``overwrite`` says what to do with; an empty or missing folder is a fresh run."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise InvalidInputError(f"output_dir={output_dir} is a file: name a folder for the run's outputs")
    found = previous_outputs(output_dir)
    if overwrite and resume and os.path.realpath(resume) in {os.path.realpath(os.path.join(output_dir, n))
                                                             for n in found}:
        raise InputError(f"--overwrite=true would delete {resume}, which --resume continues from: resume into another "
                         "--output_dir, or into this one without --overwrite")
    if found and not resume and not overwrite:
        shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
        raise InputError(f"output_dir={output_dir} holds a previous run ({shown}), which this run would overwrite: "
                         f"choose another --output_dir, continue that run with "
                         f"--resume={os.path.join(output_dir, _latest_checkpoint(found))}, or delete its outputs "
                         "with --overwrite=true")


def previous_outputs(output_dir: str) -> list[str]:
    """The names in ``output_dir`` that a unison run wrote, sorted."""
    if not os.path.isdir(output_dir):
        return []
    return [name for name in sorted(os.listdir(output_dir)) if _is_output(os.path.join(output_dir, name), name)]


def _is_output(path: str, name: str) -> bool:
    if any(fnmatch.fnmatchcase(name, pattern) for pattern in _OUTPUT_FILES):
        return os.path.isfile(path)
    return os.path.isdir(path) and bool(_CHECKPOINT.match(name) or _LEFTOVER.match(name))


def _latest_checkpoint(names: list[str]) -> str:
    steps = [int(m.group(2)) for m in map(_CHECKPOINT.match, names) if m and m.group(2)]
    return f"checkpoint-{max(steps)}" if steps else "checkpoint-N"


def clear_leftovers(output_dir: str) -> None:
    """Remove what a save killed midway left in ``output_dir``: half-written ``.checkpoint*.tmp-*`` folders and
    trainer-state temporary files inside the checkpoints. A ``.NAME.old-*`` folder holds the NAME checkpoint that a
    new one was replacing: deleted where NAME exists, else moved back to NAME (the new one never got its trainer
    state, the old one is complete)."""
    if not os.path.isdir(output_dir):
        return
    for name in sorted(os.listdir(output_dir)):
        path, leftover = os.path.join(output_dir, name), _LEFTOVER.match(name)
        if leftover and os.path.isdir(path):
            target, aside = os.path.join(output_dir, leftover.group(1)), os.path.join(path, SET_ASIDE)
            if leftover.group(2) == "old" and not os.path.exists(target) and os.path.isdir(aside):
                os.rename(aside, target)
                log.warning("restored %s from %s, where a save killed midway had left it", target, name)
            shutil.rmtree(path)
            log.warning("removed %s, left by a save killed midway", path)
        elif _CHECKPOINT.match(name) and os.path.isdir(path):
            for tmp in sorted(os.listdir(path)):
                if tmp.startswith(TRAINER_STATE_TMP_PREFIX):
                    os.remove(os.path.join(path, tmp))
                    log.warning("removed %s, left by a save killed midway", os.path.join(path, tmp))


def start_run(cfg: TrainConfig) -> MetricsWriter:
    """(Rank 0, once the model and data have loaded) delete the previous run's outputs where ``cfg.overwrite`` asks,
    write config.yaml and open the metrics, appended to when resuming."""
    if cfg.overwrite:
        remove_outputs(cfg.output_dir)
    os.makedirs(cfg.output_dir, exist_ok=True)
    dump_config(cfg, os.path.join(cfg.output_dir, CONFIG_FILE))
    trackers = build_trackers(cfg.log, cfg.output_dir, config_to_dict(cfg), bool(cfg.resume))
    return MetricsWriter(cfg.output_dir, tensorboard=cfg.log.tensorboard, resume=bool(cfg.resume), trackers=trackers)


def remove_outputs(output_dir: str) -> None:
    """Delete what ``previous_outputs`` lists, and nothing else."""
    found = previous_outputs(output_dir)
    for name in found:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if found:
        log.warning("overwrite: deleted the previous run's %s in %s", ", ".join(found), output_dir)
