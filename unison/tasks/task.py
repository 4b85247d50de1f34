"""What the policy is asked (``DataConfig``: which data set) and how it is scored (``Task``: its rows and reward
functions); ``unison.tasks.load_task`` makes one from the other."""

from __future__ import annotations

from dataclasses import dataclass, field

from unison.tasks.rewards import RewardFn, combine

# One-digit a + b / a - b. SmolLM2-135M-Instruct at T=0.7 (bench/task_probe.py, 64 samples): 27% exact,
# reward spread in every group of 8, 19 tokens per completion: low enough to climb, never all-equal.
DEFAULT_TASK = "chain_sum"


@dataclass
class DataConfig:
    source: str = DEFAULT_TASK
    """A reasoning-gym task name, or a file / ``datasets`` folder with ``prompt`` and ``answer`` columns."""
    size: int = 1000
    """Rows to generate (reasoning-gym tasks); files keep all their rows."""
    seed: int = 0
    """Generation seed (reasoning-gym tasks)."""
    gym: dict = field(default_factory=dict)
    """reasoning-gym config fields over unison's preset for the task, e.g. ``{"max_digits": 2}``."""
    system_prompt: str | None = None
    """System message; None keeps the chat template's own default."""


@dataclass(frozen=True)
class Task:
    name: str
    rows: list[dict]
    """Each row: ``prompt`` (the user message), ``answer`` (str), any other columns."""
    reward_fns: list[tuple[RewardFn, float]]
    """``(fn, weight)``; ``fn(prompts, completions, **columns) -> list[float | None]``."""
    system_prompt: str | None = None

    def score(self, completions: list[str], rows: list[dict]) -> list[float]:
        """Weighted reward of each completion of the row at the same index."""
        keys = dict.fromkeys(k for r in rows for k in r if k != "prompt")
        columns = {k: [r.get(k) for r in rows] for k in keys}
        return combine(self.reward_fns, [r["prompt"] for r in rows], completions, **columns)
