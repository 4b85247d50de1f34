"""Charts from the committed benchmark JSON files.

    python bench/charts.py        # bench/results/h200/grpo_step.json -> bench/results/h200/grpo_step.png
"""

from __future__ import annotations

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def grpo_step(path: str, png: str) -> None:
    """Seconds per GRPO step, split into generation and training, unison beside TRL, one group per workload."""
    with open(path) as f:
        data = json.load(f)
    workloads = [w for w in data["workloads"] if "s_per_step" in w.get("unison", {}) and "s_per_step" in w.get("trl",
                                                                                                                {})]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.35
    for i, w in enumerate(workloads):
        for j, (system, color) in enumerate((("unison", "#1f77b4"), ("trl", "#d62728"))):
            r, x = w[system], i + (j - 0.5) * width
            ax.bar(x, r["generate_s"], width, color=color, label=f"{system}: generation" if i == 0 else None)
            ax.bar(x, r["train_s"], width, bottom=r["generate_s"], color=color, alpha=0.45,
                   label=f"{system}: training" if i == 0 else None)
            ax.text(x, r["s_per_step"], f"{r['s_per_step']:.1f} s", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(workloads)), [w["name"] for w in workloads])
    ax.set_ylabel("seconds per GRPO step")
    ax.set_title(f"unison vs TRL GRPOTrainer ({data['device']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def main():
    results = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results", "h200")
    grpo_step(os.path.join(results, "grpo_step.json"), os.path.join(results, "grpo_step.png"))


if __name__ == "__main__":
    main()
