"""Evaluation during training: the held-out prompts through the same engine, on the live weights.

Every ``eval.steps`` steps (and after the last) each held-out prompt gets one greedy completion and ``eval.k``
sampled ones (the rollout's sampling settings), scored by the run's reward functions. A completion is correct where
the correctness reward (``eval.correct_reward``, by default the first function: accuracy for data files, the task's
own scorer for reasoning-gym tasks) is at least 1. Metrics (``eval/...``, in the step's record of metrics.jsonl):

- ``eval/greedy_accuracy``: fraction of prompts whose greedy completion is correct;
- ``eval/pass@k``: fraction of prompts with at least one correct sampled completion;
- ``eval/mean@k``: mean over prompts of the fraction of their k samples that are correct;
- ``eval/greedy_reward_mean``, ``eval/reward_mean``: the weighted reward, greedy and sampled.

The engine keeps serving the training rollouts in flight meanwhile; their completions go back to the rollout loop.
Each engine step's evaluation completions go to the scorer as they land: with reward workers
(``rollout.reward_workers``: the training's, failures counted apart) they are scored while the engine decodes the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..engine import Completion
from ..engine.stop import completion_text
from ..rollout.loop import RolloutConfig, encode_row
from ..rollout.rewards import RewardFn, RewardScorer, Scoring

log = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    steps: int = 0
    """Evaluate every this many steps and after the last (TRL's eval_steps) on the held-out rows (data.eval_split or
    data.eval_source); 0: never."""
    k: int = 4
    """Sampled completions per prompt, for pass@k and mean@k."""
    max_prompts: int = 0
    """Evaluate on the first this many held-out prompts; 0: all of them."""
    correct_reward: str = ""
    """The reward function whose value >= 1 marks a completion correct (its name as in the ``reward/<name>``
    metrics); "": the first reward function."""

    def __post_init__(self):
        for name in ("steps", "max_prompts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}")


class Evaluator:
    """Runs the evaluation on ``rows`` with ``engine``; ``reward_fns`` score it (their failures counted apart from
    the training's, as ``eval/reward_failed``), here or with ``scorer`` (the same functions, e.g. the training
    scorer's ``apart()``: on its workers)."""

    def __init__(self, cfg: EvalConfig, engine, tokenizer, rows: list[dict], reward_fns: list[tuple[RewardFn, float]],
                 rollout: RolloutConfig, stop_token_ids: list[int] | None, system_prompt: str | None, seed: int,
                 images=None, scorer: RewardScorer | None = None):
        if not rows:
            raise ValueError("eval.steps is set but there are no held-out rows: set data.eval_split (a split name "
                             "or a fraction) or data.eval_source")
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        self.rows = rows[:cfg.max_prompts] if cfg.max_prompts else rows
        self.scorer = scorer or RewardScorer(reward_fns)
        if cfg.correct_reward and cfg.correct_reward not in self.scorer.names:
            raise ValueError(f"eval.correct_reward={cfg.correct_reward!r} is none of the reward functions "
                             f"{self.scorer.names}")
        self.correct = cfg.correct_reward or self.scorer.names[0]
        self.system_prompt, self.seed = system_prompt, seed
        self.images = images  # a vision-language model's ImagePrompter, for rows with images
        self.greedy = dataclasses.replace(rollout.sampling_params(n=1, stop_token_ids=stop_token_ids), temperature=0.0)
        self.sampled = rollout.sampling_params(n=cfg.k, stop_token_ids=stop_token_ids)

    def due(self, step: int, max_steps: int) -> bool:
        return self.cfg.steps > 0 and (step % self.cfg.steps == 0 or step == max_steps)

    def run(self, land_others: Callable[[list[Completion]], None]) -> dict[str, float]:
        """Evaluate; completions of requests not the evaluation's go to ``land_others``."""
        t0 = time.perf_counter()
        mine: dict[str, tuple[int, str]] = {}  # request id -> (row index, "greedy" | "sampled")
        skipped = 0
        for i, row in enumerate(self.rows):
            try:  # the same seeds at every evaluation: the curves compare like with like
                ids, images = encode_row(self.tokenizer, row, self.system_prompt, self.images)
                for mode, params in (("greedy", self.greedy), ("sampled", self.sampled)):
                    seeded = dataclasses.replace(params, seed=self.seed * 1_000_003 + i)
                    submitted = self.engine.submit(ids, seeded, images=images) if images is not None \
                        else self.engine.submit(ids, seeded)
                    mine.update(dict.fromkeys(submitted, (i, mode)))
            except ValueError as e:  # a prompt too long for the context: skipped and counted
                skipped += 1
                log.warning("eval: skipping prompt %d: %s", i, e)
        scoring: list[tuple[list[str], Scoring]] = []  # each engine step's evaluation completions, being scored
        landed = 0
        while landed < len(mine):
            finished = self.engine.step()
            others = [c for c in finished if c.request_id not in mine]
            if others:
                land_others(others)
            done = [c for c in finished if c.request_id in mine]
            if done:
                scoring.append(([c.request_id for c in done], self._submit(done, mine)))
                landed += len(done)
        metrics = self._tally(scoring, mine)
        metrics["eval/skipped_prompts"] = float(skipped)
        metrics["eval/time_s"] = time.perf_counter() - t0
        return metrics

    def _submit(self, done: list[Completion], mine: dict[str, tuple[int, str]]) -> Scoring:
        rows = [self.rows[mine[c.request_id][0]] for c in done]
        keys = dict.fromkeys(k for row in rows for k in row if k != "prompt")
        columns = {k: [row.get(k) for row in rows] for k in keys}
        texts = [completion_text(self.tokenizer, c) for c in done]  # as the rollout's: cut before a stop string
        return self.scorer.submit([row["prompt"] for row in rows], texts, columns, [list(c.token_ids) for c in done])

    def _tally(self, scoring: list[tuple[list[str], Scoring]], mine: dict[str, tuple[int, str]]) -> dict[str, float]:
        greedy_ok, greedy_reward, sampled_reward = [], [], []
        per_prompt: dict[int, list[float]] = {}
        scored = [(r, result) for ids, pending in scoring for r, result in zip(ids, pending.result(), strict=True)]
        for r, (reward, parts) in scored:
            i, mode = mine[r]
            correct = float(parts.get(self.correct, 0.0) >= 1.0)
            if mode == "greedy":
                greedy_ok.append(correct)
                greedy_reward.append(reward)
            else:
                per_prompt.setdefault(i, []).append(correct)
                sampled_reward.append(reward)
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
        known = lambda xs: [x for x in xs if x is not None]
        k = self.cfg.k
        return {
            "eval/greedy_accuracy": mean(greedy_ok),
            f"eval/pass@{k}": mean([float(any(c)) for c in per_prompt.values()]),
            f"eval/mean@{k}": mean([mean(c) for c in per_prompt.values()]),
            "eval/greedy_reward_mean": mean(known(greedy_reward)),
            "eval/reward_mean": mean(known(sampled_reward)),
            "eval/prompts": float(len(per_prompt)),
            "eval/reward_failed": float(sum(self.scorer.missing.values())),
        }
