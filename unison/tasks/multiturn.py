"""Built-in multi-turn tasks: an environment per episode, its methods the model's tools.

``guess_number``: the environment picks a secret from 1 to ``high``; the model calls ``guess(number)`` and reads
"higher", "lower" or "correct" after each guess. Reward 1 for finding it, and 0.2 for each episode that made at least
one well-formed guess (a small model first has to learn the tool call at all). Its starting success rate on the
default model is for a GPU run to measure (``data.gym={"high": ...}`` sets the range, ``episode.max_turns`` the
guesses).
"""

from __future__ import annotations

import random

from unison.tasks.task import DataConfig, Task

PROMPT = ("I am thinking of a whole number from 1 to {high}. Find it: call the guess tool with one number per turn, "
          "and I will tell you whether my number is higher or lower. Stop when you hear 'correct'.")


class GuessNumber:
    """One game: ``reset`` picks up the row's secret; ``guess`` is the model's tool."""

    def reset(self, secret: int, high: int, **_) -> None:
        self.secret, self.high = int(secret), int(high)
        self.guesses = 0
        self.solved = False

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess, a whole number in the range.
        """
        self.guesses += 1
        if not 1 <= number <= self.high:
            return f"{number} is outside 1 to {self.high}."
        if number == self.secret:
            self.solved = True
            return "correct"
        return "higher" if number < self.secret else "lower"


def solved(prompts, completions, environments, **_) -> list[float]:
    """1 where the episode found the secret."""
    return [float(env.solved) for env in environments]


def guessed(prompts, completions, environments, **_) -> list[float]:
    """1 where the episode made at least one well-formed guess call."""
    return [float(env.guesses > 0) for env in environments]


def guess_number_task(cfg: DataConfig) -> Task:
    high = int(cfg.gym.get("high", 16))
    if high < 2:
        raise ValueError(f"guess_number: data.gym.high must be >= 2, got {high}")
    rng = random.Random(cfg.seed)
    rows = []
    for _ in range(cfg.size):
        secret = rng.randint(1, high)
        rows.append({"prompt": PROMPT.format(high=high), "secret": secret, "high": high, "answer": str(secret)})
    return Task("guess_number", rows, [(solved, 1.0), (guessed, 0.2)], cfg.system_prompt,
                environment_factory=GuessNumber)


MULTI_TURN_TASKS = {"guess_number": guess_number_task}
