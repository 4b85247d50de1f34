"""Built-in multi-turn tasks: an environment per episode, answering the model's tool calls or its plain text.

``guess_number``: the environment picks a secret from 1 to ``high``; the model calls ``guess(number)`` and reads
"higher", "lower" or "correct" after each guess. Reward 1 for finding it, and 0.2 for each episode that made at least
one well-formed guess (a small model first has to learn the tool call at all). On the default model
(SmolLM2-135M-Instruct) a GPU run measured a starting success rate of 0: it never writes a ``<tool_call>``, so no
group has a reward spread (``data.gym={"high": ...}`` sets the range, ``episode.max_turns`` the guesses).

``sum_feedback``: the default task's questions (reasoning-gym ``chain_sum``, one-digit terms, the same
``<answer></answer>`` instruction, on which the default model starts at about 0.18 reward) with feedback and
retries (``TRY_AGAIN``, before the question, says so), and no tool call to learn: the environment's ``respond``
reads the answer of each turn as the default task's rewards extract it and replies "Too high. Try again." or "Too
low. Try again." (with the format reminder), or that it found no number; a right answer ends the episode.
Rewards: ``solved`` (1.0) for a right answer within ``episode.max_turns`` turns, ``solved_first_try`` (0.2) for one
at the first attempt, so that feedback is worth using but answering right at once is best, and the default task's
``<answer>`` format (0.2) and closeness (0.3) of the last turn's answer. Closeness is the partial credit that gives
a group without a right answer a reward spread (in short CPU probes most groups of 8 had none without it, and a
run stops on such groups), and feedback moves the answer closer. On one H200 (``configs/gpu.yaml``, 40 steps) the
default model's solve rate went from 0.09 to 0.34 and its reward from 0.14 to 0.51 (first and last fifth;
``bench/results/h200/train_variants/``)::

    unison train --data.source=sum_feedback --episode.max_turns=3

``data.gym`` overrides chain_sum's preset (``{"max_digits": 2}``), as for the default task.
"""

from __future__ import annotations

import random

from unison.tasks.gym import ANSWER_FORMAT, gym_dataset, gym_row
from unison.tasks.rewards import ClosenessReward, FormatReward, extract_answer, to_number
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
    """1 where the episode solved its game (found the secret; answered the sum right)."""
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


TRY_AGAIN = "If your answer is wrong, I will tell you whether it is too high or too low, and you can try again."


class SumFeedback:
    """One question: ``respond`` judges each answer and says which way it is off. ``solved`` and ``solved_at`` (the
    attempt that got it right) are what the rewards read."""

    def reset(self, answer: str, **_) -> None:
        self.answer = to_number(answer)
        if self.answer is None:
            raise ValueError(f"sum_feedback needs a numeric answer, got {answer!r}")
        self.attempts = 0
        self.solved = False
        self.solved_at: int | None = None

    def respond(self, text: str) -> str | None:
        self.attempts += 1
        guess = to_number(extract_answer(text))
        if guess is None:
            return f"I found no number in your answer. {ANSWER_FORMAT}"
        if guess == self.answer:
            self.solved, self.solved_at = True, self.attempts
            return None
        return f"{'Too high' if guess > self.answer else 'Too low'}. Try again. {ANSWER_FORMAT}"


def solved_first_try(prompts, completions, environments, **_) -> list[float]:
    """1 where the episode's first answer was right."""
    return [float(env.solved_at == 1) for env in environments]


def sum_feedback_task(cfg: DataConfig) -> Task:
    # The sentence goes first, so that the prompt ends as the default task's does. Placed after the question, on CPU
    # at T=1.0 SmolLM2-135M echoed it ("4, not too high.") and answered 1 of 58 turns right in two short runs
    # (bench/results/cpu/sum_feedback_probe_sentence_after.json and a debug run), where 16% of its answers to the
    # default task's prompt are right (bench/results/task_probe_x86_64_cpu.json). Placed first, one run of 2 prompts
    # x 8 answered 0 of 21 turns right: too few to tell; `bench/sum_feedback_probe.py --sentence` compares them.
    rows = [{**row, "prompt": f"{TRY_AGAIN}\n{row['prompt']}"} for row in map(gym_row, gym_dataset("chain_sum", cfg))]
    fns = [(solved, 1.0), (solved_first_try, 0.2), (FormatReward(), 0.2), (ClosenessReward(), 0.3)]
    return Task("sum_feedback", rows, fns, cfg.system_prompt, environment_factory=SumFeedback)


MULTI_TURN_TASKS = {"guess_number": guess_number_task, "sum_feedback": sum_feedback_task}
