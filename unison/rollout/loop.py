"""The rollout loop: prompts in, scored samples with group advantages out.

It keeps up to ``max_concurrent_rollouts`` samples in flight in the engine, scores each completion as it lands,
computes a group's advantages when its last sample is scored, and hands out batches of ``samples_per_step``. The
caller steps it between training steps; nothing runs in the background (DESIGN.md: one host thread), except the
reward functions where ``reward_workers`` gives them processes of their own: the loop then steps the engine while
they score, and files their results in the order the completions landed.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from ..dist.runtime import ReadyAgreement
from ..engine import Completion, GenerationEngine, SamplingParams
from ..engine.seeding import group_seed
from ..engine.stop import completion_texts
from ..vision.messages import chat_messages
from .advantage import group_advantages
from .rewards import RewardFn, RewardScorer, Scored, Scorer, Scoring
from .sample import Sample, shown

if TYPE_CHECKING:
    from ..vision.prompt import ImagePrompt, ImagePrompter

log = logging.getLogger(__name__)

AUTO_REWARD_WORKERS = 2
"""``rollout.reward_workers="auto"`` where the engine generates on a GPU."""


@dataclass
class RolloutConfig:
    group_size: int = 8
    """Samples per prompt (G); advantages are relative within a group."""
    samples_per_step: int = 32
    """Scored samples per optimizer step (of all data-parallel replicas together); a multiple of group_size."""
    max_concurrent_rollouts: int = 64
    """Samples in flight in the engine at once (per engine: each data-parallel replica has one)."""
    max_new_tokens: int = 128
    """The longest completion, in tokens (a longer one ends with finish "length")."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy); the trainer's logprobs use the same one."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose mass reaches top_p; 1 keeps all."""
    top_k: int = 0
    """0 keeps the whole vocabulary."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 keeps all. Like top_p/top_k, a cut makes the
    engine's sampling distribution differ from the trained one (importance sampling sees it as mismatch)."""
    repetition_penalty: float = 1.0
    """HF's: the raw logit x of each token already in the prompt or the completion becomes x / p if x > 0 else
    x * p; 1 is off."""
    stop: list[str] = dataclasses.field(default_factory=list)
    """Stop strings: a completion ends at the first occurrence of any of them. Its tokens (trained on) run through
    the token that completes the string; the text the rewards see ends before it."""
    max_staleness: int = 1
    """Samples sampled more than this many weight versions ago are dropped."""
    advantage_eps: float = 1e-6
    """Added to the group's reward std in (r - mean) / (std + eps)."""
    reward_workers: int | Literal["auto"] = "auto"
    """Worker processes that run the reward functions while the engine generates (0: they run on the loop's thread,
    between engine steps, while the GPU waits). "auto": 2 where the engine generates on a GPU (its host's cores are
    otherwise idle), 0 on the CPU (workers would take the engine's cores). math-verify takes ~3 ms of a CPU core a
    completion: inline, 0.33 s of a 1.64 s 0.6B step on an H100, against 1.34 s with 2 workers
    (bench/results/h100/speed/rewards/). The functions must pickle and live in an importable module (those defined
    in the script that runs score inline, with a warning where workers were asked for)."""
    reward_timeout_s: float = 300.0
    """With reward_workers: a worker that takes longer on one engine step's completions (counted from when it has
    loaded the reward functions) is stopped and their rewards counted as failures; one that takes longer to load the
    functions turns scoring inline for the run (inline, a hung verifier hangs the run)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """TRL's: 'group' divides each group's centred rewards by the group's std; 'batch' by the std of the trained
    batch's rewards (every replica's; PPO-Lite); 'none' keeps them centred only (Dr. GRPO). The population std plus
    advantage_eps (TRL: Bessel-corrected, + 1e-4); groups whose rewards are all equal are dropped in every mode."""

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative within a group), got {self.group_size}")
        if self.samples_per_step < 1 or self.samples_per_step % self.group_size:
            raise ValueError(f"samples_per_step ({self.samples_per_step}) must be a positive multiple of "
                             f"group_size ({self.group_size})")
        if self.max_concurrent_rollouts < self.group_size:
            raise ValueError(f"max_concurrent_rollouts ({self.max_concurrent_rollouts}) must hold at least one "
                             f"group ({self.group_size})")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.reward_workers != "auto" and not (isinstance(self.reward_workers, int) and self.reward_workers >= 0):
            raise ValueError(f"reward_workers must be 'auto' or an int >= 0, got {self.reward_workers!r}")
        if not self.reward_timeout_s > 0:
            raise ValueError(f"reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {self.scale_rewards!r}")
        self.sampling_params()  # validates the sampling fields

    def workers_for(self, device: torch.device | str) -> int:
        """``reward_workers`` for an engine that generates on ``device`` ("auto" resolved)."""
        if self.reward_workers != "auto":
            return self.reward_workers
        return AUTO_REWARD_WORKERS if torch.device(device).type == "cuda" else 0

    def sampling_params(self, **fields) -> SamplingParams:
        """The engine's sampling parameters of this section (``fields`` set the rest: n, stop_token_ids, ...)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                              stop=tuple(self.stop), **fields)


@dataclass
class _Group:
    row: dict
    prompt_text: str | list[dict]  # the row's prompt: the user message, or a conversation
    pending: int  # samples still in the engine
    landed: list[tuple[Completion, float | None, dict]]  # with what the completion log shows of it
    images: ImagePrompt | None = None  # a vision-language prompt's images, shared by the group's samples


class RolloutLoop:
    """``scorer`` scores the completions (None: a ``RewardScorer`` of ``reward_fns``; under tensor parallelism one
    that scores on rank 0 for all ranks); ``agreement`` makes data-parallel replicas train together (None: this
    loop alone)."""

    def __init__(self, engine: GenerationEngine, tokenizer, rows: list[dict],
                 reward_fns: list[tuple[RewardFn, float]], cfg: RolloutConfig, stop_token_ids: list[int] | None = None,
                 seed: int = 0, system_prompt: str | None = None, max_sample_tokens: int | None = None, *,
                 scorer: Scorer | None = None, agreement: ReadyAgreement | None = None,
                 images: ImagePrompter | None = None):
        if not rows:
            raise ValueError("no prompts to roll out")
        self.engine, self.tokenizer, self.rows, self.cfg = engine, tokenizer, rows, cfg
        self.images = images  # a vision-language model's: rows with images go through its tower once per prompt
        self.system_prompt = system_prompt
        # The trainer's packed row: a sample (prompt and completion) never outgrows it. A longer prompt's completion
        # is cut short (finish "length"); a prompt that fills the row is skipped and counted.
        self.max_sample_tokens = max_sample_tokens
        # (An engine elsewhere, a server's, has no device here: "auto" scores inline, as on the CPU.)
        self.scorer = scorer or RewardScorer(reward_fns, cfg.workers_for(getattr(engine, "device", "cpu")),
                                             cfg.reward_timeout_s, asked=cfg.reward_workers != "auto")
        self.agreement = agreement
        self.params = cfg.sampling_params(n=cfg.group_size, stop_token_ids=stop_token_ids)
        self.rng = random.Random(seed)
        # Each group samples with its own seed: its completions then depend only on the run's seed, never on what
        # else the engine batches with it (preemption, KV lending, the concurrency setting).
        self.seed_rng = random.Random(f"{seed}/sampling")
        self.order: list[int] = []
        self.epoch = 0
        self.in_engine: dict[str, _Group] = {}  # request id (as submit returned it) -> its group
        # What engine steps finished and the scorer has yet to score, in the order they landed: what landed first,
        # its scoring last, ``_file``'s arguments (the multi-turn loop's: its ended episodes, their scoring).
        self.scoring: deque[tuple] = deque()
        self.ready: list[Sample] = []
        self.counts = Counter()
        self.window: dict[str, list[float]] = {"reward": [], "length": [], "truncated": []}
        self.window_parts: dict[str, list[float]] = {}
        self.gen_tokens = 0
        self.gen_time = 0.0
        self.reward_wait = 0.0  # seconds the loop spent scoring, or waiting for the reward workers

    def next_batch(self, trainer_version: int) -> tuple[list[Sample], dict[str, float]]:
        """Step the engine until ``samples_per_step`` fresh scored samples are ready; return them and metrics.

        With data-parallel replicas (``self.agreement``) ``samples_per_step`` counts the samples of all of them, and
        this replica returns its agreed share."""
        t0 = time.perf_counter()
        start_epoch, engine_steps = self.epoch, 0
        while True:
            stuck = self.epoch > start_epoch + 2
            if stuck:  # what is still being scored counts before the loop calls itself stuck
                self._file_scored(behind=0)
            self._drop_stale(trainer_version)
            take = self._take(stuck, engine_steps)
            if take is not None:
                break
            self._fill()
            # Reward workers that fall behind by more than the engine holds: wait for them (the engine would
            # otherwise run through the prompts ahead of the rewards).
            self._file_scored(behind=self.cfg.max_concurrent_rollouts)
            t = time.perf_counter()
            completions = self.engine.step()
            self.gen_time += time.perf_counter() - t
            self._land(completions)
            engine_steps += 1
        batch, self.ready = self.ready[:take], self.ready[take:]
        metrics = self._metrics(batch, trainer_version, time.perf_counter() - t0)
        metrics["rollout/engine_steps"] = float(engine_steps)
        return batch, metrics

    def _take(self, stuck: bool, engine_steps: int) -> int | None:
        """How many ready samples to train on now, or None to keep rolling out. ``stuck``: two passes over the
        prompts since the batch was asked for."""
        if self.agreement is None:
            if len(self.ready) >= self.cfg.samples_per_step:
                return self.cfg.samples_per_step
            if stuck:
                raise RuntimeError(self._no_batch())
            return None
        if engine_steps % self.agreement.every:  # the same cadence on every replica: the collectives match
            return None
        # A stuck replica that still holds samples contributes them; one with none says so here, and every replica
        # stops at this agreement at once.
        stuck = stuck and not self.ready
        if stuck:
            log.error(self._no_batch())
        shares = self.agreement.shares(len(self.ready), stuck)
        return shares[self.agreement.replica.rank] if shares is not None else None

    def _no_batch(self) -> str:
        # Missing rewards first: a reward function that always fails (or never applies) leaves every group with
        # fewer than two scored, which alone would read as rewards without spread.
        missing = self.scorer.missing_report()
        if missing is None:  # tensor parallelism: rank 0 scores
            missing = "the rewards were scored on another rank, whose error names any that were missing"
        return (f"two passes over the prompts gave no batch: {missing + '; ' if missing else ''}"
                f"{self.counts['zero_std_groups']} groups so far had rewards without spread (all equal, or fewer than "
                "two scored), which carry no signal")

    def state_dict(self) -> dict:
        """Data order and sampling seeds (for resuming); groups in flight are not saved: they are rolled out
        again after a resume."""
        return {"rng": self.rng.getstate(), "seed_rng": self.seed_rng.getstate(), "order": list(self.order),
                "epoch": self.epoch, "counts": dict(self.counts)}

    def load_state_dict(self, saved: dict) -> None:
        """``saved["order"]`` indexes the rows it was saved with: an empty order starts a fresh pass over these."""
        if any(i >= len(self.rows) for i in saved["order"]):
            raise ValueError(f"the saved data order indexes row {max(saved['order'])}, and this loop has "
                             f"{len(self.rows)} rows: load it with an empty order to start a fresh pass over them")
        self.rng.setstate(saved["rng"])
        self.seed_rng.setstate(saved["seed_rng"])
        self.order, self.epoch = list(saved["order"]), saved["epoch"]
        self.counts.update(saved["counts"])

    @property
    def in_flight(self) -> int:
        return len(self.in_engine)

    def _fill(self) -> None:
        skipped_in_a_row = 0
        while self.in_flight + self.cfg.group_size <= self.cfg.max_concurrent_rollouts:
            # The prompts that fit, encoded together: a vision-language model's images go through its tower at once.
            room = (self.cfg.max_concurrent_rollouts - self.in_flight) // self.cfg.group_size
            rows = [self._next_row() for _ in range(room)]
            for row, encoded in zip(rows, encode_rows(self.tokenizer, rows, self.system_prompt, self.images),
                                    strict=True):
                try:
                    if isinstance(encoded, Exception):
                        raise encoded
                    ids, images = encoded
                    params = self._params_for(len(ids))
                    request_ids = (self.engine.submit(ids, params, images=images) if images is not None
                                   else self.engine.submit(ids, params))
                except ValueError as e:  # e.g. a prompt longer than the context: skipped and counted
                    self.counts["skipped_prompts"] += 1
                    log.warning("skipping a prompt: %s", e)
                    skipped_in_a_row += 1
                    if skipped_in_a_row >= len(self.rows):  # a whole pass without a usable prompt
                        if not self.in_engine:
                            raise RuntimeError(f"no prompt can be rolled out; the last was skipped because: {e}") \
                                from e
                        return
                    continue
                skipped_in_a_row = 0
                self.in_engine.update(dict.fromkeys(request_ids, _Group(row, row["prompt"], len(request_ids), [],
                                                                        images)))

    def _params_for(self, prompt_tokens: int) -> SamplingParams:
        params = dataclasses.replace(self.params, seed=group_seed(self.seed_rng))
        if self.max_sample_tokens is None or prompt_tokens + params.max_new_tokens <= self.max_sample_tokens:
            return params
        room = self.max_sample_tokens - prompt_tokens
        if room < 1:
            raise ValueError(f"a prompt of {prompt_tokens} tokens leaves no room for a completion in a training row "
                             f"of {self.max_sample_tokens} tokens (step.max_tokens_per_row)")
        return dataclasses.replace(params, max_new_tokens=room)

    def _next_row(self) -> dict:
        if not self.order:
            self.order = list(range(len(self.rows)))
            self.rng.shuffle(self.order)
            self.epoch += 1
        return self.rows[self.order.pop()]

    def land(self, completions: list[Completion]) -> None:
        """File the completions of this loop's requests that an engine step taken by another caller returned (an
        evaluation stepping the same engine); others are left to that caller."""
        self._land([c for c in completions if c.request_id in self.in_engine])

    def _land(self, completions: list[Completion]) -> None:
        """Submit what one engine step finished for scoring (in one call: one collective under tensor parallelism),
        then file each scored completion with its group, in the order they landed."""
        if completions:  # most engine steps finish none
            groups = [self.in_engine.pop(c.request_id) for c in completions]  # out of the engine: room to fill
            finished = [(c, g) for c, g in zip(completions, groups, strict=True)
                        if c.finish_reason != "abort" and c.token_ids]
            rows = [g.row for _, g in finished]
            keys = dict.fromkeys(k for row in rows for k in row if k != "prompt")
            columns = {k: [row.get(k) for row in rows] for k in keys}
            texts = completion_texts(self.tokenizer, [c for c, _ in finished])  # cut before a stop string
            t = time.perf_counter()
            scoring = self.scorer.submit([g.prompt_text for _, g in finished], texts, columns,
                                         [list(c.token_ids) for c, _ in finished]) if finished else Scored([])
            self.reward_wait += time.perf_counter() - t
            self.scoring.append((completions, groups, [c.request_id for c, _ in finished], texts, scoring))
            self.gen_tokens += sum(len(c.token_ids) for c, _ in finished)
        self._file_scored()

    def _file_scored(self, behind: int | None = None) -> None:
        """File the engine steps whose completions are scored, oldest first; with ``behind``, first wait until no
        more than that many completions are still being scored."""
        unscored = sum(len(completions) for completions, *_ in self.scoring)
        while self.scoring and (self.scoring[0][-1].done() or (behind is not None and unscored > behind)):
            entry = self.scoring.popleft()
            unscored -= len(entry[0])
            self._file(*entry)

    def _file(self, completions: list[Completion], groups: list[_Group], scored_ids: list[str], texts: list[str],
              scoring: Scoring) -> None:
        t = time.perf_counter()
        scores = dict(zip(scored_ids, scoring.result(), strict=True))
        self.reward_wait += time.perf_counter() - t
        texts = dict(zip(scored_ids, texts, strict=True))
        for completion, group in zip(completions, groups, strict=True):
            group.pending -= 1
            if completion.request_id not in scores:  # aborted, or finished without a token
                self.counts["aborted"] += 1
            else:
                reward, parts = scores[completion.request_id]
                group.landed.append((completion, reward, shown(group.prompt_text, texts[completion.request_id],
                                                               reward, parts, group.row)))
                self._record(len(completion.token_ids), completion.finish_reason, reward, parts)
            if group.pending == 0:
                self._close(group, completion.group_id)

    def _record(self, length: int, finish_reason: str, reward: float | None, parts: dict[str, float]) -> None:
        """A landed sample's length, truncation and reward (its parts) in the metrics window."""
        self.window["length"].append(length)
        self.window["truncated"].append(float(finish_reason == "length"))
        if reward is None:
            self.counts["missing_reward"] += 1
        else:
            self.window["reward"].append(reward)
            for name, value in parts.items():
                self.window_parts.setdefault(name, []).append(value)

    def _close(self, group: _Group, group_id: str) -> None:
        scored = [(c, r, record) for c, r, record in group.landed if r is not None]
        advantages = group_advantages([r for _, r, _ in scored], self.cfg.advantage_eps, self.cfg.scale_rewards)
        if advantages is None:
            self.counts["zero_std_groups"] += 1
            return
        self.counts["groups"] += 1
        for (c, r, record), a in zip(scored, advantages, strict=True):
            self.ready.append(Sample(tuple(c.prompt_ids), tuple(c.token_ids), tuple(c.logprobs),
                                     tuple(c.weight_versions), r, a, group_id, c.finish_reason, images=group.images,
                                     shown=record))

    def _drop_stale(self, trainer_version: int) -> None:
        fresh = [s for s in self.ready if trainer_version - s.oldest_version <= self.cfg.max_staleness]
        self.counts["stale_samples"] += len(self.ready) - len(fresh)
        self.ready = fresh

    def _metrics(self, batch: list[Sample], trainer_version: int, wait_s: float) -> dict[str, float]:
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
        staleness = [trainer_version - s.oldest_version for s in batch]
        # Rewards and lengths of every completion scored since the last batch, zero-std groups included (the trained
        # ones alone overstate how often the policy succeeds); the batch's own when nothing new landed (a batch of
        # samples that were ready before it was asked for: reward workers let the engine run ahead).
        landed = bool(self.window["length"])
        m = {
            "reward/mean": mean(self.window["reward"] or [s.reward for s in batch]),
            "reward/trained_mean": mean([s.reward for s in batch]),
            "completion/length_mean": mean(self.window["length"] if landed else
                                           [len(s.completion_ids) for s in batch]),
            "completion/truncated_frac": mean(self.window["truncated"] if landed else
                                              [float(s.finish_reason == "length") for s in batch]),
            "rollout/wait_s": wait_s,
            "rollout/tokens_per_s": self.gen_tokens / self.gen_time if self.gen_time else 0.0,
            "rollout/reward_wait_s": self.reward_wait,
            "rollout/staleness_mean": mean(staleness),
            "rollout/staleness_max": float(max(staleness, default=0)),
            "rollout/epoch": float(self.epoch),
        }
        for name, values in self.window_parts.items():
            m[f"reward/{name}"] = mean(values)
        for name in ("zero_std_groups", "groups", "skipped_prompts", "missing_reward", "stale_samples", "aborted"):
            m[f"rollout/{name}"] = float(self.counts[name])
        for name in self.scorer.names:  # completions each reward function failed to score, so far
            m[f"reward/failed/{name}"] = float(self.scorer.missing[name])
        self.window = {k: [] for k in self.window}
        self.window_parts = {}
        self.gen_tokens, self.gen_time, self.reward_wait = 0, 0.0, 0.0
        return m


def encode_row(tokenizer, row: dict, system_prompt: str | None = None, images: ImagePrompter | None = None
               ) -> tuple[list[int], ImagePrompt | None]:
    """A row's prompt ids, and its images through the vision tower where it has some (``images``: the model's
    ``ImagePrompter``; a row with images and none is refused with ValueError)."""
    pictures = row.get("images")
    if not pictures:
        return encode_prompt(tokenizer, row["prompt"], system_prompt), None
    if images is None:
        raise ValueError(f"a row with {len(pictures)} image(s) needs a vision-language model (unison.vision.model)")
    return images(chat_messages(row["prompt"], pictures, system_prompt), pictures)


def encode_rows(tokenizer, rows: list[dict], system_prompt: str | None = None, images: ImagePrompter | None = None
                ) -> list[tuple[list[int], ImagePrompt | None] | ValueError]:
    """``encode_row`` of each row, the rows with images through the tower together (``ImagePrompter.batch``); a row
    that cannot be encoded comes back as its ValueError."""
    out: list = [None] * len(rows)
    pictured = [i for i, row in enumerate(rows) if row.get("images")]
    for i in set(range(len(rows))) - set(pictured):
        try:
            out[i] = encode_row(tokenizer, rows[i], system_prompt, images)
        except ValueError as e:
            out[i] = e
    if pictured and images is None:
        for i in pictured:
            out[i] = ValueError(f"a row with {len(rows[i]['images'])} image(s) needs a vision-language model")
    elif pictured:
        batch = images.batch([(chat_messages(rows[i]["prompt"], rows[i]["images"], system_prompt), rows[i]["images"])
                              for i in pictured])
        for i, encoded in zip(pictured, batch, strict=True):
            out[i] = encoded if isinstance(encoded, Exception) else tuple(encoded)
    return out


def encode_prompt(tokenizer, text: str | list[dict], system_prompt: str | None = None) -> list[int]:
    """The chat template applied (assistant turn opened) where the tokenizer has one, else the plain text. ``text``
    is the user message, or a conversation (``{"role", "content"}`` messages; ``system_prompt`` goes first unless
    it opens with a system message of its own)."""
    conversation = isinstance(text, list)
    if not getattr(tokenizer, "chat_template", None):
        if conversation:
            raise ValueError("a conversational prompt (a list of messages) needs a tokenizer with a chat template")
        return tokenizer(text)["input_ids"]
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if conversation and text and text[0].get("role") == "system":
        messages = []
    # A text-only row's part lists ({"type": "text"} parts) as the plain strings text chat templates expect.
    messages += [{**m, "content": _text_of(m["content"])} for m in text] if conversation else [
        {"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _text_of(content: str | list[dict]) -> str:
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content if p.get("type") == "text")
