"""Per-step metrics: one JSON line per step, TensorBoard scalars, and a PNG of the curves.

``metrics.jsonl`` is the record (append-only, one ``{"step": ..., key: value}`` object per line, NaN and
inf written as null); TensorBoard, ``curves.png`` and any experiment trackers (W&B, trackio:
``unison.train.reporting``) are views of it. ``NullMetricsWriter`` has the same
methods and does nothing (non-zero ranks, tests, runs without a run directory).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from typing import Protocol

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PREVIOUS_METRICS_FILES = "metrics.prev-*.jsonl"  # where a new run in a used directory moves the old metrics.jsonl
CURVES_FILE = "curves.png"

# Panels drawn first, in this order, when present; every other logged key follows in order of first use.
PREFERRED_PANELS = (
    "reward/mean", "loss", "is/clipfrac", "mismatch/logprob_diff_mean", "time/step_s",
    "reward/std", "is/ratio_mean", "is/dropped_frac", "mismatch/logprob_diff_max", "mismatch/kl",
    "clip/low", "clip/high",
)
SMOOTHED = ("reward/mean",)  # noisy per-step curves that get a smoothed line on top
MAX_PANELS = 16


class Metrics(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def plot(self, path: str | None = None) -> str | None: ...
    def close(self) -> None: ...


class MetricsWriter:
    """Writes ``run_dir/metrics.jsonl`` and, with ``tensorboard=True``, TensorBoard events in ``run_dir``.

    With ``resume=True`` an existing ``metrics.jsonl`` is appended to, so a resumed run keeps one history; a new
    run in a used directory moves the old file aside (``metrics.prev-N.jsonl``) instead of mixing two runs.
    """

    def __init__(self, run_dir: str, tensorboard: bool = True, resume: bool = False, trackers: Iterable = ()):
        os.makedirs(run_dir, exist_ok=True)
        self.trackers = list(trackers)  # each with log(step, metrics), log_completions(step, records), close()
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, METRICS_FILE)
        if not resume and os.path.exists(self.path):
            n = 1
            while os.path.exists(os.path.join(run_dir, PREVIOUS_METRICS_FILES.replace("*", str(n)))):
                n += 1
            os.replace(self.path, os.path.join(run_dir, PREVIOUS_METRICS_FILES.replace("*", str(n))))
        self._file = open(self.path, "a", buffering=1)  # line-buffered: a crash loses at most one line
        if _ends_mid_line(self.path):  # a torn last line from a killed run must not swallow the next record
            self._file.write("\n")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the `tensorboard` package

            self._tb = SummaryWriter(log_dir=run_dir)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record one step. Values are anything ``float()`` takes (ints, 0-d tensors); NaN/inf become null."""
        record: dict[str, float | int | None] = {"step": int(step)}
        for key, value in metrics.items():
            if key == "step":
                raise ValueError("'step' is the step number, not a metric name")
            try:
                number = float(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"metric {key!r} is not a number: {value!r}") from e
            record[key] = number if math.isfinite(number) else None
            if self._tb is not None and math.isfinite(number):
                self._tb.add_scalar(key, number, int(step))
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        finite = {k: v for k, v in record.items() if k != "step" and v is not None}
        for tracker in self.trackers:
            tracker.log(int(step), finite)

    def log_completions(self, step: int, records: list[dict]) -> None:
        """Sampled completions (dicts of prompt, completion, rewards): TensorBoard text and the trackers."""
        if self._tb is not None:
            text = "\n\n".join("  \n".join(f"**{k}**: {v}" for k, v in r.items() if k != "step") for r in records)
            self._tb.add_text("completions", text, int(step))
        for tracker in self.trackers:
            tracker.log_completions(int(step), records)

    def plot(self, path: str | None = None) -> str | None:
        """Render the curves logged so far to ``path`` (default ``run_dir/curves.png``); returns the path."""
        self._file.flush()
        if self._tb is not None:
            self._tb.flush()
        return plot_metrics(self.path, path or os.path.join(self.run_dir, CURVES_FILE))

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullMetricsWriter:
    """The do-nothing writer: same interface, records nothing."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def log_completions(self, step: int, records: list[dict]) -> None:
        pass

    def plot(self, path: str | None = None) -> str | None:
        return None

    def close(self) -> None:
        pass

    def __enter__(self) -> NullMetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _ends_mid_line(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def read_metrics(path: str) -> list[dict[str, float | None]]:
    """The records of a ``metrics.jsonl``; a torn last line (a run killed mid-write) is skipped."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and "step" in record:
                records.append(record)
    return records


def plot_metrics(metrics_path: str, png_path: str, keys: Iterable[str] | None = None) -> str | None:
    """Draw one panel per metric from a ``metrics.jsonl`` into ``png_path``; None if nothing was logged."""
    records = read_metrics(metrics_path)
    keys = list(keys) if keys is not None else _panel_keys(records)
    if not keys:
        return None
    from matplotlib.figure import Figure  # no pyplot: no global backend, safe off the main thread

    cols = min(4, len(keys))
    rows = math.ceil(len(keys) / cols)
    width, height = 4 * cols, 2.8 * rows
    fig = Figure(figsize=(width, height))
    # Fixed margins (inches at the edges): a constrained layout measures every label first, 2.2 s of the 4 s that
    # 16 panels took on a 2-core CPU, at the end of every run.
    fig.subplots_adjust(left=0.6 / width, right=1 - 0.15 / width, bottom=0.5 / height, top=1 - 0.3 / height,
                        wspace=0.25, hspace=0.55)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, key in zip(axes, keys, strict=False):
        steps = [r["step"] for r in records if key in r]
        values = [math.nan if r[key] is None else r[key] for r in records if key in r]
        ax.plot(steps, values, lw=1, alpha=0.5 if key in SMOOTHED else 1.0)
        if key in SMOOTHED and len(values) > 2:
            ax.plot(steps, ema(values), lw=2, label="smoothed")
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    tmp = f"{png_path}.tmp.png"  # write then rename: a viewer never sees half a PNG
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, png_path)
    return png_path


def ema(values: list[float], weight: float = 0.9) -> list[float]:
    """TensorBoard-style debiased exponential moving average; NaN entries are skipped, not propagated."""
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        if not math.isnan(v):
            avg, norm = weight * avg + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(avg / norm if norm else math.nan)
    return out


def _panel_keys(records: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for record in records:
        for key in record:
            if key != "step":
                seen.setdefault(key)
    evals = [k for k in seen if k == "eval/greedy_accuracy" or k.startswith(("eval/pass@", "eval/mean@"))]
    first = [k for k in PREFERRED_PANELS if k in seen] + evals  # evaluation accuracy is drawn whenever logged
    keys = first + [k for k in seen if k not in first]
    if len(keys) > MAX_PANELS:
        logger.debug("plotting %d of %d metrics (%s)", MAX_PANELS, len(keys), ", ".join(keys[MAX_PANELS:]))
    return keys[:MAX_PANELS]
