import json
import math
import os

import pytest
import torch

from unison.metrics import MetricsWriter, NullMetricsWriter, ema, plot_metrics, read_metrics


def test_jsonl_tensorboard_and_png(tmp_path):
    run_dir = str(tmp_path / "run")
    with MetricsWriter(run_dir) as writer:
        for step in range(1, 6):
            writer.log(step, {"reward/mean": step / 5, "loss": torch.tensor(0.5), "time/step_s": 2,
                              "is/clipfrac": math.nan if step == 3 else 0.1, "mismatch/kl": math.inf})
        png = writer.plot()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON: NaN/inf would not parse as null
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0] == {"step": 1, "reward/mean": 0.2, "loss": 0.5, "time/step_s": 2.0,
                          "is/clipfrac": 0.1, "mismatch/kl": None}
    assert records[2]["is/clipfrac"] is None
    assert png == os.path.join(run_dir, "curves.png")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    events = [name for name in os.listdir(run_dir) if name.startswith("events.out.tfevents")]
    assert len(events) == 1 and os.path.getsize(os.path.join(run_dir, events[0])) > 0


def test_tensorboard_events_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(str(tmp_path)) as writer:
        writer.log(1, {"reward/mean": 0.25, "bad": math.nan})
        writer.log(2, {"reward/mean": 0.75})
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["reward/mean"]  # a NaN is left out, not written as a point
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]


def test_resume_appends_and_torn_line_is_skipped(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        writer.log(1, {"loss": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "lo')  # a run killed mid-write
    with MetricsWriter(str(tmp_path), tensorboard=False, resume=True) as writer:
        writer.log(3, {"loss": 0.5})
    assert not any(name.startswith("events") for name in os.listdir(tmp_path))
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (3, 0.5)]


def test_a_new_run_moves_the_old_history_aside(tmp_path):
    for loss in (1.0, 2.0, 3.0):
        with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
            writer.log(1, {"loss": loss})
    assert [r["loss"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [3.0]  # no mixing of runs
    assert [r["loss"] for r in read_metrics(str(tmp_path / "metrics.prev-1.jsonl"))] == [1.0]  # nothing lost
    assert [r["loss"] for r in read_metrics(str(tmp_path / "metrics.prev-2.jsonl"))] == [2.0]


def test_bad_metric_names_the_key(tmp_path):
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        with pytest.raises(TypeError, match="metric 'name' is not a number"):
            writer.log(1, {"name": "abc"})
        with pytest.raises(ValueError, match="'step' is the step number"):
            writer.log(1, {"step": 3})


def test_plot_only_logged_keys(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    assert plot_metrics(str(path), str(tmp_path / "empty.png")) is None
    assert not (tmp_path / "empty.png").exists()
    with MetricsWriter(str(tmp_path), tensorboard=False) as writer:
        writer.log(1, {"custom/thing": 1.0})
        assert writer.plot(str(tmp_path / "c.png")) == str(tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 0


def test_ema_skips_nan_and_debiases():
    assert ema([2.0, 2.0, math.nan, 2.0]) == pytest.approx([2.0, 2.0, 2.0, 2.0])
    smoothed = ema([0.0, 1.0], weight=0.5)
    assert smoothed[1] == pytest.approx(2 / 3)


def test_null_writer_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with NullMetricsWriter() as writer:
        writer.log(1, {"loss": 1.0})
        assert writer.plot() is None
    assert os.listdir(tmp_path) == []
