"""What the policy is asked (``DataConfig``: which data set) and how it is scored (``Task``: its rows and reward
functions); ``unison.tasks.load_task`` makes one from the other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from unison.tasks.rewards import RewardFn, combine

# One-digit a + b / a - b. SmolLM2-135M-Instruct at T=0.7 (bench/task_probe.py, 64 samples): 27% exact,
# reward spread in every group of 8, 19 tokens per completion: low enough to climb, never all-equal.
DEFAULT_TASK = "chain_sum"


@dataclass
class DataConfig:
    source: str = DEFAULT_TASK
    """A reasoning-gym task name; a built-in task (``sum_feedback``, ``guess_number``: multi-turn; ``count_shapes``:
    drawn images); a data file (.jsonl, .json, .csv; .parquet and ``datasets`` folders through the ``datasets``
    package); or a Hugging Face Hub data set id (``openai/gsm8k``, through ``datasets``). Rows may carry images (an
    ``images`` column, or image parts in a conversation)."""
    prompt_column: str = "prompt"
    """The column holding the prompt: a string (the user message) or a conversation (a list of ``{role,
    content}`` messages, rendered by the tokenizer's chat template)."""
    answer_column: str = "answer"
    """The column holding the reference answer, passed to reward functions as ``answer`` (and under its own
    name); "": rows need none (reward functions that read other columns)."""
    subset: str | None = None
    """The Hub data set's configuration name (``main`` for openai/gsm8k)."""
    split: str = "train"
    """The split to train on (Hub data sets and ``datasets`` folders with several)."""
    eval_split: float | str | None = None
    """Held-out rows for evaluation (``eval.steps``): a split name of ``source`` (``test``), or a fraction in (0, 1)
    of its rows, held out of training (chosen with ``seed``). None: ``eval_source``, or no evaluation."""
    eval_source: str = ""
    """A separate file or data set to evaluate on (its default split, the same columns)."""
    size: int = 1000
    """Rows to generate (reasoning-gym and built-in tasks); files keep all their rows."""
    seed: int = 0
    """Generation seed (reasoning-gym and built-in tasks)."""
    gym: dict = field(default_factory=dict)
    """reasoning-gym config fields over unison's preset for the task, e.g. ``{"max_digits": 2}``; a built-in
    task's settings (count_shapes: ``{"image_size": 112, "max_shapes": 6}``)."""
    system_prompt: str | None = None
    """System message; None keeps the chat template's own default."""

    def __post_init__(self):
        if isinstance(self.eval_split, float) and not 0 < self.eval_split < 1:
            raise ValueError(f"eval_split must be a split name or a fraction in (0, 1), got {self.eval_split}")
        if self.eval_split is not None and self.eval_source:
            raise ValueError("set eval_split (held out of source) or eval_source (another data set), not both")
        if not self.prompt_column:
            raise ValueError("prompt_column must name a column")


@dataclass(frozen=True)
class Task:
    name: str
    rows: list[dict]
    """Each row: ``prompt`` (the user message, or a list of messages), ``answer`` (str), any other columns."""
    reward_fns: list[tuple[RewardFn, float]]
    """``(fn, weight)``; ``fn(prompts, completions, **columns) -> list[float | None]``."""
    system_prompt: str | None = None
    eval_rows: list[dict] = field(default_factory=list)
    """Held-out rows to evaluate on (``DataConfig.eval_split`` / ``eval_source``); empty: none."""
    tools: list[Callable] = field(default_factory=list)
    """Plain tool functions for multi-turn episodes (``unison.episodes``); empty with no environment: single-turn."""
    environment_factory: Callable[[], object] | None = None
    """Makes one environment per episode (TRL's shape: ``reset(**row)``, public methods the tools; a
    ``respond(text)`` method answers the model's turns without tool calls)."""

    @property
    def multi_turn(self) -> bool:
        return bool(self.tools) or self.environment_factory is not None

    def score(self, completions: list[str], rows: list[dict]) -> list[float]:
        """Weighted reward of each completion of the row at the same index."""
        keys = dict.fromkeys(k for r in rows for k in r if k != "prompt")
        columns = {k: [r.get(k) for r in rows] for k in keys}
        return combine(self.reward_fns, [r["prompt"] for r in rows], completions, **columns)
