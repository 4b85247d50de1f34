"""What crosses the engine's boundary: its config, a request's sampling parameters, a completion."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..config import check_literals


@dataclass
class EngineConfig:
    num_blocks: int = 256
    """KV blocks in the pool, shared by all layers and requests. 0 in a `unison train` config: sized from the
    rollout settings (an Engine itself needs >= 1)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_batch_tokens: int = 2048
    """Tokens computed per step (prefill chunks + one per decoding request)."""
    max_num_seqs: int = 256
    """Requests running at once."""
    max_model_len: int | None = None
    """Context length (prompt + completion); None: the model's max_position_embeddings."""
    inflight_policy: Literal["keep", "recompute"] = "keep"
    """At a weight update, running requests keep their KV (cheapest) or re-prefill with the new weights."""
    prefix_caching: bool = True
    """Share full prompt blocks between requests (a group's samples, repeated prompts)."""
    seed: int | None = None
    """Seed of the engine's generator for requests without their own seed."""
    attention: Literal["auto", "torch", "triton"] = "auto"
    """The engine's kernels: paged attention, and the sampler of rows without top-k/top-p (the fused one-pass
    sampler with triton). auto: the Triton kernels on CUDA, the pure-PyTorch reference elsewhere."""
    cuda_graphs: bool = True
    """With the Triton backend, run decode-only steps through CUDA graphs (captured per batch size on first use;
    on the CPU the same static-buffer path runs eagerly)."""

    def __post_init__(self):
        if self.num_blocks < 0:
            raise ValueError(f"EngineConfig.num_blocks must be >= 0 (0: sized by unison train), got {self.num_blocks}")
        for name in ("block_size", "max_batch_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        check_literals(self, "EngineConfig.")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 keeps the whole vocabulary."""
    n: int = 1
    """Samples of the prompt (a group); they share the prompt's KV blocks."""
    stop_token_ids: tuple[int, ...] | None = None
    """Stop on any of these ids (the stop token is part of the completion). None: the model's eos ids."""
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True)
class Completion:
    """One finished sample. ``logprobs[i]`` is the logprob of ``token_ids[i]`` under the distribution it was
    drawn from; ``weight_versions[i]`` the weight version that sampled it."""

    request_id: str
    group_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length", "abort"]
    weight_versions: list[int] = field(default_factory=list)
