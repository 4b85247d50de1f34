"""reasoning-gym tasks: generated questions, scored by each task's own ``score_answer``."""

from __future__ import annotations

from unison.config import InvalidInputError
from unison.tasks.rewards import ClosenessReward, ExactAnswerReward, FormatReward
from unison.tasks.task import DataConfig, Task

# The easiest settings of each task: SmolLM2-135M-Instruct solved none of reasoning-gym's default
# settings; bench/task_probe.py measures these presets.
PRESETS: dict[str, dict] = {
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"),
                             allow_parentheses=False, allow_negation=False),
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "products": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "leg_counting": dict(min_animals=1, max_animals=2, min_instances=1, max_instances=3),
    "letter_counting": dict(min_words=1, max_words=3),
    "spell_backward": dict(min_word_len=3, max_word_len=4),
    "word_sequence_reversal": dict(min_words=2, max_words=3),
}

# Shown after every question. No worked example: SmolLM2-135M copies it ("The answer is: 42"); on one-digit
# sums (bench/task_probe.py) "for example <answer>42</answer>" cut exact answers from 27% to 22% at T=1.0
# and from 58% to 41% at T=0.7.
ANSWER_FORMAT = "Put the final answer in <answer></answer> tags."


def gym_task(cfg: DataConfig) -> Task:
    """Rows of ``reasoning_gym.create_dataset(cfg.source, ...)`` over unison's preset and ``cfg.gym``.

    Rewards: the task's own scorer on the extracted answer (1.0), ``<answer>`` format (0.2) and, for
    numeric answers, closeness (0.3).
    """
    import reasoning_gym

    if cfg.source not in reasoning_gym.factory.DATASETS:
        raise InvalidInputError(f"data.source={cfg.source!r} is neither a file nor a reasoning-gym task; tasks "
                         f"with presets: {sorted(PRESETS)}")
    dataset = gym_dataset(cfg.source, cfg)
    rows = [gym_row(entry) for entry in dataset]
    fns = [(ExactAnswerReward(GymScore(dataset)), 1.0), (FormatReward(), 0.2), (ClosenessReward(), 0.3)]
    return Task(cfg.source, rows, fns, cfg.system_prompt)


def gym_dataset(name: str, cfg: DataConfig):
    """``reasoning_gym.create_dataset(name, ...)`` of ``cfg.size`` entries over unison's preset and ``cfg.gym``."""
    import reasoning_gym

    if cfg.size < 1:
        raise ValueError(f"data.size must be >= 1, got {cfg.size}")
    options = {**PRESETS.get(name, {}), **cfg.gym}
    try:
        return reasoning_gym.create_dataset(name, size=cfg.size, seed=cfg.seed, **options)
    except TypeError as e:  # an unknown config field
        raise ValueError(f"data.gym for {name}: {e}") from None


def gym_row(entry: dict, answer_format: str = ANSWER_FORMAT) -> dict:
    prompt = f"{entry['question'].strip()}\n{answer_format}"
    return {"prompt": prompt, "answer": str(entry["answer"]), "question": entry["question"],
            "metadata": entry.get("metadata", {})}


class GymScore:
    """``score(extracted_answer, row)`` through the reasoning-gym dataset's own ``score_answer``."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __call__(self, answer: str, row: dict) -> float:
        entry = {"question": row.get("question", ""), "answer": row["answer"], "metadata": row.get("metadata", {})}
        return float(self.dataset.score_answer(answer, entry))

