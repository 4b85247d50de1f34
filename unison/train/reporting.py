"""Where a run reports: TensorBoard, Weights & Biases, trackio (``log.report_to``), and the sampled completions.

metrics.jsonl is always written (``unison.metrics``); each tracker named in ``report_to`` gets the same finite
scalars. wandb and trackio are optional extras, imported only when named: ``pip install wandb`` /
``pip install trackio``. W&B honours its own environment (``WANDB_MODE=offline`` writes the run under
``output_dir/wandb/`` without an account).

Every ``log.completions_every`` steps ``log.completions_per_log`` samples of the batch that step trained on (prompt,
completion, the weighted reward, each reward function's value, the advantage; a sample of each group first, then a
second of each, ...) go to ``completions.jsonl`` in the run directory, one JSON object per completion with its step,
and to TensorBoard as text (and to W&B as a table). Groups whose rewards did not differ are not trained, so not
shown (``reward/mean`` counts them).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from ..rollout.sample import Sample

log = logging.getLogger(__name__)

COMPLETIONS_FILE = "completions.jsonl"


@dataclass
class LogConfig:
    report_to: list[Literal["none", "tensorboard", "wandb", "trackio"]] = field(
        default_factory=lambda: ["tensorboard"])
    """Trackers that get the metrics besides metrics.jsonl (TRL's report_to): tensorboard, wandb, trackio; [none] or
    []: none."""
    project: str = "unison"
    """The W&B / trackio project."""
    run_name: str = ""
    """The W&B / trackio run name; "": the output_dir's folder name."""
    completions_every: int = 0
    """Log sampled completions every this many steps (completions.jsonl, TensorBoard text, a W&B table); 0: never."""
    completions_per_log: int = 8
    """Completions logged each time: samples of the batch that step trained on, one of each group before a second."""

    def __post_init__(self):
        if "none" in self.report_to and len(self.report_to) > 1:
            raise ValueError(f"report_to: 'none' cannot be combined with trackers, got {self.report_to}")
        if self.completions_every < 0 or self.completions_per_log < 1:
            raise ValueError("completions_every must be >= 0 and completions_per_log >= 1")

    @property
    def tensorboard(self) -> bool:
        return "tensorboard" in self.report_to


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def log_completions(self, step: int, records: list[dict]) -> None: ...
    def close(self) -> None: ...


def build_trackers(cfg: LogConfig, run_dir: str, config: dict, resume: bool) -> list[Tracker]:
    """The experiment trackers ``cfg.report_to`` names besides TensorBoard (which ``MetricsWriter`` writes)."""
    name = cfg.run_name or os.path.basename(os.path.abspath(run_dir))
    trackers: list[Tracker] = []
    if "wandb" in cfg.report_to:
        trackers.append(WandbTracker(cfg.project, name, run_dir, config, resume))
    if "trackio" in cfg.report_to:
        trackers.append(TrackioTracker(cfg.project, name, config, resume))
    return trackers


def _optional(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(f"log.report_to names {module}, which is not installed: `pip install {module}` (or "
                          f"`pip install unison[{module}]`), or drop it from log.report_to") from None


class WandbTracker:
    def __init__(self, project: str, name: str, run_dir: str, config: dict, resume: bool):
        self.wandb = _optional("wandb")
        self.run = self.wandb.init(project=project, name=name, dir=run_dir, config=config,
                                   resume="allow" if resume else None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_completions(self, step: int, records: list[dict]) -> None:
        columns = sorted({k for r in records for k in r if k != "step"})
        table = self.wandb.Table(columns=columns, data=[[_plain(r.get(c)) for c in columns] for r in records])
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker:
    def __init__(self, project: str, name: str, config: dict, resume: bool):
        self.trackio = _optional("trackio")
        self.trackio.init(project=project, name=name, config=config, resume="allow" if resume else "never")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.trackio.log(dict(metrics), step=step)

    def log_completions(self, step: int, records: list[dict]) -> None:
        pass  # scalars only: the completions are in completions.jsonl

    def close(self) -> None:
        self.trackio.finish()


def _plain(value: Any) -> Any:
    return value if isinstance(value, int | float | str | type(None)) else json.dumps(value)


class CompletionLog:
    """Writes ``per_log`` samples of a step's batch, spread over its groups (what their rollout loop showed of them,
    ``Sample.shown``) to ``run_dir/completions.jsonl`` and the trackers, every ``every`` steps."""

    def __init__(self, run_dir: str, every: int, per_log: int, writer):
        self.path = os.path.join(run_dir, COMPLETIONS_FILE)
        self.every, self.per_log, self.writer = every, per_log, writer

    def after_step(self, step: int, batch: list[Sample]) -> None:
        if not self.every or step % self.every:
            return
        shown = [s for s in batch if s.shown is not None]
        seen, place = Counter(), []  # the first sample of each group, then the second of each, ...: every prompt
        for sample in shown:
            seen[sample.group_id] += 1
            place.append(seen[sample.group_id])
        spread = sorted(range(len(shown)), key=lambda i: (place[i], i))
        records = [{"step": step, **shown[i].shown, "advantage": shown[i].advantage} for i in spread[:self.per_log]]
        if not records:
            return
        with open(self.path, "a") as f:
            for record in records:
                f.write(json.dumps(record, default=str) + "\n")
        self.writer.log_completions(step, records)
