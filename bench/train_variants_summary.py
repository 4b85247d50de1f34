"""Summarise bench/train_variants.sh's runs: reward first and last fifth, each reward function's, s/step (the median
after the first step), engine-vs-trainer mismatch; writes NAME.json and NAME.png (reward curves) beside the metrics.

    python bench/train_variants_summary.py FOLDER [NAME]
"""

import json
import statistics
import sys
from pathlib import Path


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise(name: str, records: list[dict]) -> dict:
    k = max(1, len(records) // 5)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    out = {"steps": len(records),
           "reward_first_fifth": mean([r["reward/mean"] for r in records[:k]]),
           "reward_last_fifth": mean([r["reward/mean"] for r in records[-k:]]),
           "s_per_step_median": statistics.median(r["time/step_s"] for r in records[1:]) if len(records) > 1 else None,
           "logprob_diff_mean": mean([r["mismatch/logprob_diff_mean"] for r in records])}
    for key in sorted({key for r in records for key in r if key.startswith("reward/") and key != "reward/mean"}):
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            out[f"{key}_first_fifth"] = mean(values[:k])
            out[f"{key}_last_fifth"] = mean(values[-k:])
    return out


def plot(root: Path, runs: dict[str, list[dict]], png: Path) -> None:
    """reward/mean per step of each curve run (not the *_alone timing runs), one panel."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3.5), layout="constrained")
    ax = fig.subplots()
    for name, records in runs.items():
        if not name.endswith("_alone"):
            ax.plot([r["step"] for r in records], [r["reward/mean"] for r in records], label=name, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean")
    ax.legend()
    fig.savefig(png, dpi=110)


def main(folder: str, name: str = "summary") -> None:
    root = Path(folder)
    runs = {p.name.removesuffix(".metrics.jsonl"): rows(p) for p in sorted(root.glob("*.metrics.jsonl"))}
    summary = {name_: summarise(name_, records) for name_, records in runs.items() if records}
    (root / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    try:
        plot(root, {n: r for n, r in runs.items() if r}, root / f"{name}.png")
    except ImportError:  # no matplotlib on this machine: the JSON is the result
        pass
    print(f"{'run':12s} {'steps':>5s} {'reward 1st':>10s} {'last':>6s} {'s/step':>7s} {'|dlogp|':>9s}")
    for name, s in summary.items():
        sps = s["s_per_step_median"]
        print(f"{name:12s} {s['steps']:5d} {s['reward_first_fifth']:10.3f} {s['reward_last_fifth']:6.3f} "
              f"{sps if sps is not None else float('nan'):7.2f} {s['logprob_diff_mean']:9.2e}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
