"""The configuration of a `unison train` run: one section per component, each defined next to its class.

    unison train                                   # the built-in default: SmolLM2-135M-Instruct, CPU-sized
    unison train run.yaml --optim.lr=2e-6 --rollout.group_size=16
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..dist.runtime import DistConfig
from ..engine import EngineConfig
from ..models import ModelConfig
from ..rollout.loop import RolloutConfig
from ..sync.publisher import SyncConfig
from ..tasks import DataConfig
from .loss import LossConfig
from .memory import MemoryConfig
from .optimizer import OptimConfig


@dataclass
class StepConfig:
    max_tokens_per_row: int = 0
    """Packed row length; each row is one micro-batch of the step. 0 (auto): 8192 where the memory plan fits in
    85% of the GPU with it, else 4096, else 2048 (on the CPU 4096); never shorter than the longest sampled prompt
    plus ``rollout.max_new_tokens``. No sample outgrows a row: a longer prompt's completion is cut to fit (counted
    in ``completion/truncated_frac``), a prompt that fills a row is skipped (``rollout/skipped_prompts``)."""
    logprob_chunk: int = 1024
    """Tokens per chunk of the lm_head in the policy logprobs: [chunk, vocab] is the largest logits block."""

    def __post_init__(self):
        if self.max_tokens_per_row != 0 and self.max_tokens_per_row < 2:
            raise ValueError(f"max_tokens_per_row must be 0 (auto) or >= 2, got {self.max_tokens_per_row}")
        if self.logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1, got {self.logprob_chunk}")


@dataclass
class TrainConfig:
    output_dir: str = "runs/default"
    """Run directory: config.yaml, metrics.jsonl, TensorBoard events, curves.png, checkpoint/. One that holds a
    previous run is refused unless ``resume`` or ``overwrite`` is set."""
    overwrite: bool = False
    """Start afresh in an ``output_dir`` that holds a previous run: its checkpoints, metrics, TensorBoard events,
    curves.png and config.yaml are deleted first; any other file there is left alone."""
    max_steps: int = 25
    seed: int = 0
    save_every: int = 0
    """Also save a checkpoint every this many steps (0: only at the end)."""
    tensorboard: bool = True
    resume: str = ""
    """A checkpoint directory this command wrote (``checkpoint-N``): continue from its weights, optimizer state,
    step, data order and seeds, up to max_steps, appending to ``output_dir``'s metrics. Rollouts that were in flight
    are generated again. Settings that differ from the checkpoint's are named in a warning (another ``dist.tp`` or
    number of processes is refused: each rank holds its shard of the optimizer state); another data set starts a
    fresh pass over its rows."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # CPU-sized default: 4 prompts x 8 samples per step, completions up to 64 tokens (bench/task_probe.py).
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(
        group_size=8, samples_per_step=32, max_concurrent_rollouts=64, max_new_tokens=64))
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_blocks=0, block_size=16))
    """num_blocks 0: sized from the rollout settings (see memory)."""
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=2e-5))
    step: StepConfig = field(default_factory=StepConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self):
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.save_every < 0:
            raise ValueError(f"save_every must be >= 0, got {self.save_every}")
