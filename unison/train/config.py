"""The configuration of a `unison train` run: one section per component, each defined next to its class.

    unison train                                   # the built-in default: SmolLM2-135M-Instruct, CPU-sized
    unison train run.yaml --optim.lr=2e-6 --rollout.group_size=16
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..dist.runtime import DistConfig
from ..engine import EngineConfig
from ..episodes.loop import EpisodeConfig
from ..models import ModelConfig
from ..rollout.loop import RolloutConfig
from ..rollout.reward_config import RewardSpec
from ..sync.publisher import SyncConfig
from ..tasks import DataConfig
from .evaluate import EvalConfig
from .loss import LossConfig
from .memory import MemoryConfig
from .optimizer import OptimConfig
from .reporting import LogConfig


@dataclass
class StepConfig:
    max_tokens_per_row: int = 0
    """Packed row length; each row is one micro-batch of the step. 0 (auto): 16384 where the memory plan fits in
    85% of the GPU with it, else 8192, 4096, 2048 (on the CPU 4096; the KV pool is never lent for rows beyond
    8192); never shorter than the longest sampled prompt plus ``rollout.max_new_tokens``. No sample outgrows a
    row: a longer prompt's completion is cut to fit (counted in ``completion/truncated_frac``), a prompt that fills
    a row is skipped (``rollout/skipped_prompts``)."""
    logprob_chunk: int = 1024
    """Tokens per chunk of the lm_head in the policy logprobs: [chunk, vocab] is the largest logits block."""
    fused_kernels: bool = True
    """On the GPU, the training forward's RMSNorm, RoPE and SwiGLU and the lm_head's softmax reductions run as
    unison's Triton kernels, forward and backward (unison.train.fused), the same function in the same precision, and
    the packed rows' attention as cuDNN's fused kernels where its frontend is installed (unison[gpu];
    unison.engine.cudnn_attention); false: transformers' modules, PyTorch's operations and flash attention (the
    optimizer's AdamW kernels stay on)."""
    num_iterations: int = 1
    """Optimizer updates per batch (TRL's; mu in the GRPO paper). The trainer's logprobs before the first are the
    later ones' PPO denominator. Weight versions count updates: a sample one batch old is num_iterations versions
    old, so keep rollout.max_staleness >= num_iterations to train in-flight samples; the lr schedule spans
    max_steps x num_iterations updates."""

    def __post_init__(self):
        if self.max_tokens_per_row != 0 and self.max_tokens_per_row < 2:
            raise ValueError(f"max_tokens_per_row must be 0 (auto) or >= 2, got {self.max_tokens_per_row}")
        if self.logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1, got {self.logprob_chunk}")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}")


@dataclass
class TrainConfig:
    output_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, TensorBoard events, curves.png, checkpoint/. One that holds a
    previous run is refused unless ``resume`` or ``overwrite`` is set."""
    overwrite: bool = False
    """Start afresh in an ``output_dir`` that holds a previous run: its checkpoints, metrics, TensorBoard events,
    curves.png and config.yaml are deleted first; any other file there is left alone."""
    max_steps: int = 25
    """Optimizer steps to run (a resumed run continues up to this step)."""
    seed: int = 0
    """Seeds the data order, the sampling (each group's seed derives from it) and the initial torch state."""
    save_every: int = 0
    """Also save a checkpoint every this many steps (0: only at the end)."""
    save_final: bool = True
    """Save the final ``checkpoint`` after the last step; false: none (a benchmark or a dry run: ``save_every``'s
    are still written)."""
    save_total_limit: int = 0
    """Keep only the newest this many ``checkpoint-N`` folders (TRL's); the final ``checkpoint`` is always kept. 0:
    keep all."""
    resume: str = ""
    """A checkpoint directory this command wrote (``checkpoint-N``): continue from its weights, optimizer state,
    step, data order and seeds, up to max_steps, appending to ``output_dir``'s metrics. Rollouts that were in flight
    are generated again. Settings that differ from the checkpoint's are named in a warning (another ``dist.tp`` or
    number of processes is refused: each rank holds its shard of the optimizer state); another data set starts a
    fresh pass over its rows."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: list[RewardSpec] = field(default_factory=list)
    """Reward functions replacing the task's: ``[{fn: "package.module:function", weight: 1.0, args: {}}]`` with
    TRL's signature, or built-ins (accuracy, exact, closeness, format, soft_overlong_punishment); see
    unison.rollout.reward_config. []: the task's own."""
    # CPU-sized default: 4 prompts x 8 samples per step, completions up to 64 tokens (bench/task_probe.py).
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(
        group_size=8, samples_per_step=32, max_concurrent_rollouts=64, max_new_tokens=64))
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_blocks=0, block_size=16))
    """The generation engine; with num_blocks 0 its KV pool is sized from the rollout settings (see memory)."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Multi-turn episodes (tasks with tools or an environment, e.g. data.source=sum_feedback or guess_number)."""
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-5))
    step: StepConfig = field(default_factory=StepConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    renamed_keys: ClassVar[dict[str, str]] = {"tensorboard": "log.report_to (--log.report_to=[tensorboard] or [none])"}

    def __post_init__(self):
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {self.save_every}")
        if self.save_total_limit < 0:
            raise ValueError(f"save_total_limit must be >= 0, got {self.save_total_limit}")
