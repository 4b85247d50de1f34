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
    """The engine's kernels: paged attention, and the sampler of batches without top-k/top-p/min-p (the fused
    one-pass sampler with triton; the repetition penalty is applied before either sampler). auto: the Triton
    kernels on CUDA, the pure-PyTorch reference elsewhere."""
    mla_cache: Literal["latent", "expanded"] = "latent"
    """Multi-head latent attention (DeepSeek-V2/V3 families): cache each token's compressed latent and attend with
    the up-projections absorbed (latent), or cache the per-head keys and values the attention function receives
    (expanded: heads * (qk_nope + qk_rope + v_head_dim) per token instead of kv_lora_rank + qk_rope_head_dim)."""
    lora_weights: Literal["auto", "unmerged", "merged"] = "auto"
    """A LoRA policy's adapters in the engine: run through PEFT's layers (unmerged: base + s B A x from the adapters'
    own tensors, no copy), or from a copy of each adapted weight, W + s B A, recomputed from the adapters at every
    weight update (merged: the base model's decode kernels, one more copy of the adapted weights). auto: merged on a
    GPU where the copy takes at most a quarter of its memory (on one H200 unmerged decode took 35-67% longer than the
    base model, merged 1-10%: bench/results/h200/lora), else unmerged (the CPU, tensor parallelism, a 32B model)."""
    cuda_graphs: bool = True
    """With the Triton backend, run decode-only steps through CUDA graphs (captured per batch size on first use;
    on the CPU the same static-buffer path runs eagerly)."""
    row_graphs: bool = True
    """Prefill steps of short prompt chunks (a rollout's prompts, a tool's reply, the decode rows beside them) through
    CUDA graphs too, every token a query row of the decode kernel (unison.engine.row_graphs): on an H100 a step of
    8 x 64 prompt tokens took 3.7-4.6 ms against 17.7-19.4 ms eagerly, a staggered multi-turn rollout 1.03 s against
    1.25-1.37 s (bench/results/h100/speed/rows). Taken within 2048 rows and 6 GiB of keys and values a layer (fewer
    rows for larger models); not for vision prompts, hybrid layer states, MLA caches, experts or tensor parallelism.
    Needs cuda_graphs; ``UNISON_ROW_GRAPHS=0`` turns it off too."""
    piece_graphs: bool = True
    """The other eager steps (more prompt tokens than the row graphs take: long prompts, a large token budget) through
    CUDA graphs captured in pieces, one a layer, per padded token count up to max_batch_tokens; each layer's attention
    runs eagerly between two (unison.engine.piece_graphs). A prefill step of 8192 tokens at 0.6B took 21.4 ms against
    35.7 eagerly on an H200 (bench/results/h200/speed/goals5/pieces), 24-27 against 25-42 on an H100; decode at 256
    requests of 128 + 256 tokens gained 1-9% on both; where the host keeps up with the eager step they cost ~2 ms of
    it, the cuts' two copies (26.4 against 24.1 ms on an H100; pieces/profile under bench/results/h100/speed/pieces).
    Same models as row_graphs; needs cuda_graphs. ``UNISON_PIECE_GRAPHS=1`` or
    ``=0`` decides whatever this says."""
    async_scheduling: bool = True
    """Overlap the host's work with the device's in decode-only steps through the runner (cuda_graphs): the next step
    is launched, fed the tokens the last one sampled on the device, before those are read back (unison.engine.overlap).
    A request that stops meanwhile computes one more token, thrown away. Steps with a waiting request, top-k/top-p/
    min-p, a repetition penalty, or a hybrid model's layer states run synchronously; the tokens are the same."""
    prefill_wait_steps: int = 64
    """New prefill work (a prompt, the tokens a multi-turn extend appends) that arrives within this many decode
    steps of the last prefill waits out the rest while more requests decode than wait, so that frequent arrivals
    share one eager step instead of each stopping the CUDA-graph decode steps for one of its own; an arrival after a
    quiet spell is prefilled at once (unison.engine.scheduler). 0: always at the next step. An eager step costs
    about 27 decode steps (0.6B, 64 requests, one H200: 37 against 1.37 ms); multi-turn episodes there took 1.17 s
    at 64 against 1.51-1.60 s at 16 (bench/results/h200/speed/multiturn). With row_graphs those steps are graphs
    too and the hold matters less (an H100: 1.20, 0.99, 1.03 and 1.08 s at 0, 4, 16 and 64)."""
    moe_kernel: Literal["triton", "transformers"] = "triton"
    """A mixture-of-experts model's experts in the engine's forwards on CUDA: unison's Triton kernels (the routing
    permutation folded into their loads, no host sync; two layouts: the common one, gate and up concatenated, no
    bias, SiLU, and GptOss's, transposed, interleaved, biased, its clamped SwiGLU), or the model's own transformers
    experts implementation (grouped_mm by default). Training and the CPU always run the latter, as do other
    layouts."""

    def __post_init__(self):
        if self.num_blocks < 0:
            raise ValueError(f"EngineConfig.num_blocks must be >= 0 (0: sized by unison train), got {self.num_blocks}")
        for name in ("block_size", "max_batch_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_wait_steps < 0:
            raise ValueError(f"EngineConfig.prefill_wait_steps must be >= 0, got {self.prefill_wait_steps}")
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
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (after top-k/top-p); 0 keeps all."""
    repetition_penalty: float = 1.0
    """HF's: the logit x of each token in the prompt or the output so far becomes x / p if x > 0 else x * p,
    before temperature; 1 is off."""
    n: int = 1
    """Samples of the prompt (a group); they share the prompt's KV blocks."""
    stop_token_ids: tuple[int, ...] | None = None
    """Stop on any of these ids (the stop token is part of the completion). None: the model's eos ids."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings: the completion ends at the first occurrence of any of them in its decoded text (the engine
    needs the tokenizer). Its tokens run through the token that completes the string (sampled, with its logprob);
    ``completion_text`` cuts the text before the string (excluded, as vLLM does by default)."""

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
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 is off), "
                             f"got {self.repetition_penalty}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
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
    stop_string: str | None = None
    """The stop string (``SamplingParams.stop``) that ended it; None when a stop token, the length or an abort
    did."""
