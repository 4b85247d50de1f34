"""TRL's GRPOTrainer (trl 1.16) on a given GRPO workload, timed step by step: the baseline that
``bench/grpo_step.py`` compares unison against.

One optimizer step = ``len(prompts)`` prompts x ``group`` completions of at most ``new_tokens`` tokens (temperature
1, full vocabulary), random rewards in [0, 1) (seeded, so group advantages are non-zero), one AdamW step at a
constant ``lr``. TRL is configured for speed as its docs describe:

- generation: transformers continuous batching (``use_transformers_continuous_batching``) in-process on the policy
  itself (no vLLM, no weight sync), CUDA graphs off as TRL's docs advise (the weights change every step), the
  KV-cache pool at TRL's default of 50% of free GPU memory; it is allocated for each generation and counts in
  ``peak_gib``;
- one generation round per optimizer step: ``generation_batch_size`` = the step's samples,
  ``steps_per_generation`` = ``gradient_accumulation_steps`` (1 by default: the whole step is one micro-batch),
  ``num_iterations=1``. TRL then skips the "old logprobs" forward (the ratio is 1 by construction), so a step is
  generate, one training forward + backward over prompt+completion, clip (TRL default max norm 1), AdamW;
- ``beta=0`` (no reference model), TRL's default loss (``dapo``, group-scaled rewards), no gradient checkpointing
  (TRL turns it on by default), no saving, no eval, logging every step.

On CUDA the model is loaded in bf16 and AdamW steps the bf16 weights themselves (no fp32 master copy; TRL also
casts the policy to bf16 before each continuous-batching generation); on CPU it is float32 for a quick test.

Step seconds are taken by a ``TrainerCallback`` (``on_step_begin`` to ``on_step_end``, with a device sync);
generation seconds by wrapping ``GRPOTrainer._generate_single_turn`` (the backend's ``generate_batch`` call).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import AutoTokenizer, TrainerCallback


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _StepTimer(TrainerCallback):
    """Wall seconds of each optimizer step, from ``on_step_begin`` to ``on_step_end``."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        _sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        _sync()
        self.step_s.append(time.perf_counter() - self._t0)


def _timed(fn: Callable, seconds: list[float]) -> Callable:
    """``fn`` that appends its synced wall seconds to ``seconds`` on every call."""

    def wrapper(*args, **kwargs):
        _sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        _sync()
        seconds.append(time.perf_counter() - t0)
        return out

    return wrapper


def run_trl(checkpoint: str, prompts: list[str], group: int, new_tokens: int, lr: float, steps: int,
            out_dir: str, seed: int = 0, micro_batch: int | None = None) -> dict[str, Any]:
    """Train ``steps`` GRPO steps with TRL on ``checkpoint`` and return their timings (see the module docstring).

    ``micro_batch`` (default: all ``len(prompts) * group`` samples) splits a step's training forward/backward into
    gradient-accumulation micro-batches; it must divide the step's samples and be a multiple of ``group``.
    """
    import trl  # imported here so that grpo_step.py runs without trl installed when it does not compare
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    samples = len(prompts) * group
    micro_batch = micro_batch or samples
    if samples % micro_batch or micro_batch % group:
        raise ValueError(f"micro_batch {micro_batch} must divide {samples} samples and be a multiple of {group}")
    accumulation = samples // micro_batch
    config = dict(
        model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"},
        bf16=cuda,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,  # generation_batch_size = micro_batch * accumulation = samples
        num_generations=group,
        num_iterations=1,
        max_completion_length=new_tokens,
        temperature=1.0,
        beta=0.0,
        learning_rate=lr,
        lr_scheduler_type="constant",
        optim="adamw_torch_fused",  # the transformers default on torch>=2.8
        gradient_checkpointing=False,
        use_transformers_continuous_batching=True,
        transformers_continuous_batching_config={"use_cuda_graph": False},
        shuffle_dataset=False,  # step k trains on exactly the given prompts (the k-th copy of the list)
        max_steps=steps,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    args = GRPOConfig(output_dir=out_dir, **config)
    if args.generation_batch_size != samples:
        raise AssertionError(f"TRL generation batch {args.generation_batch_size} != {samples} samples per step")

    rng = random.Random(seed)

    def random_reward(completions: list, **kwargs) -> list[float]:
        return [rng.random() for _ in completions]

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = GRPOTrainer(
        model=checkpoint,
        reward_funcs=random_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": list(prompts) * steps}),
        processing_class=AutoTokenizer.from_pretrained(checkpoint),
    )
    timer = _StepTimer()
    trainer.add_callback(timer)
    generate_step_s: list[float] = []
    trainer._generate_single_turn = _timed(trainer._generate_single_turn, generate_step_s)
    trainer.train()

    if len(timer.step_s) != steps or len(generate_step_s) != steps:
        raise AssertionError(f"{len(timer.step_s)} steps, {len(generate_step_s)} generations; expected {steps} each")
    measured = slice(1 if steps > 1 else 0, None)  # the first step includes warm-up
    s_per_step = statistics.mean(timer.step_s[measured])
    generate_s = statistics.mean(generate_step_s[measured])
    lengths = [log["completions/mean_length"] for log in trainer.state.log_history if "completions/mean_length" in log]
    return {
        "s_per_step": s_per_step,
        "step_s": timer.step_s,
        "generate_s": generate_s,
        "generate_step_s": generate_step_s,
        "train_s": s_per_step - generate_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "completion_tokens_mean": statistics.mean(lengths),
        "trl_version": trl.__version__,
        "config": config,
    }
