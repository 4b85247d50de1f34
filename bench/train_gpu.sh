#!/usr/bin/env bash
# The default model and task trained on one GPU, then 5 steps at lr 0 (engine/trainer agreement in bf16).
# Run from the repo root on a GPU machine with unison's dependencies installed; results under $OUT (or ./runs).
set -euo pipefail
out=${OUT:-runs}
python3 -m unison train configs/gpu.yaml --output_dir=/tmp/gpu_run --overwrite=true
python3 -m unison train configs/gpu.yaml --output_dir=/tmp/gpu_lr0 --overwrite=true --optim.lr=0.0 --max_steps=5 --log.report_to=[none]
mkdir -p "$out/gpu_run" "$out/gpu_lr0"
cp /tmp/gpu_run/metrics.jsonl /tmp/gpu_run/curves.png /tmp/gpu_run/config.yaml "$out/gpu_run/"
cp /tmp/gpu_lr0/metrics.jsonl "$out/gpu_lr0/"
python3 - "$out" <<'PY'
import json, sys
for run in ("gpu_run", "gpu_lr0"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/{run}/metrics.jsonl")]
    k = max(1, len(rows) // 5)
    mean = lambda xs: sum(xs) / len(xs)
    print(run, "steps", len(rows), "reward first fifth %.3f last fifth %.3f" % (
        mean([r["reward/mean"] for r in rows[:k]]), mean([r["reward/mean"] for r in rows[-k:]])),
        "s/step %.2f" % mean([r["time/step_s"] for r in rows[1:]]),
        "dlogp mean %.2e max %.2e clipfrac %.2e" % (mean([r["mismatch/logprob_diff_mean"] for r in rows]),
        max(r["mismatch/logprob_diff_max"] for r in rows), mean([r["is/clipfrac"] for r in rows])))
PY
