"""Where a colocated run's GPU memory goes: a plan at startup, and an out-of-memory error explained in words.

One GPU holds the bf16 weights (read by the engine and trained), their gradients, the optimizer's fp32 masters
and moments (unless ``optim.placement=host``), the engine's KV pool (lent to the training step with
``memory.lend_kv``) and the training step's activations. The KV pool is sized from the rollout settings:
``max_concurrent_rollouts`` requests of the longest prompt plus ``max_new_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import check_literals
from ..dist.runtime import local
from ..lora import is_lora
from ..vision.model import is_vision_model, vision_trains


@dataclass
class MemoryConfig:
    lend_kv: Literal["auto", "always", "never"] = "auto"
    """Hand the engine's KV pool to the training step; in-flight rollouts recompute their KV afterwards. auto: on
    a GPU, where the step's memory plan needs it: unless keeping the pool fits the plan in 85% of the GPU with rows
    as long as lending allows (lending costs every step a pool release, an allocator flush and recomputed in-flight
    KV: 0.15 s of a 1.7B model's 4.1 s step on an H200, bench/results/h200/memory.json). Never on the CPU (the pool
    is host memory, and recomputing costs more than it frees)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass instead of keeping them."""


    def __post_init__(self):
        check_literals(self, "memory.")

    def lends(self, device: torch.device) -> bool:
        """Whether the step may borrow the pool (``choose_lending`` decides ``auto`` on a GPU from the plan)."""
        return self.lend_kv == "always" or (self.lend_kv == "auto" and device.type == "cuda")


def choose_lending(lend_kv: str, may_lend: bool, plan_for: Callable[[bool], tuple[MemoryPlan, int]]
                   ) -> tuple[bool, MemoryPlan, int]:
    """(lend, plan, row tokens). ``plan_for(lend)`` gives the plan and the packed row length with and without
    lending; ``may_lend``: ``MemoryConfig.lends``. ``auto`` keeps the pool where that plan fits in
    ``AUTO_DEVICE_FRACTION`` of the GPU with rows at least as long as lending's, up to ``LEND_FOR_ROWS``: longer
    rows are taken where they fit, never lent for."""
    if not may_lend:
        return (False, *plan_for(False))
    lent, lent_rows = plan_for(True)
    if lend_kv == "always":
        return True, lent, lent_rows
    kept, kept_rows = plan_for(False)
    if min(kept_rows, LEND_FOR_ROWS) >= min(lent_rows, LEND_FOR_ROWS) and kept.fits(AUTO_DEVICE_FRACTION):
        return False, kept, kept_rows
    return True, lent, lent_rows


@dataclass
class MemoryPlan:
    rows: list[tuple[str, float, str]]  # (what, GiB, note)
    device_gib: float | None

    @property
    def total_gib(self) -> float:
        return sum(gib for _, gib, _ in self.rows)

    def fits(self, fraction: float) -> bool:
        """Whether the estimate is within ``fraction`` of the device (always, without a device size)."""
        return self.device_gib is None or self.total_gib <= fraction * self.device_gib

    def table(self) -> str:
        lines = [f"{'memory plan':28s} {'GiB':>8s}"]
        lines += [f"  {what:26s} {gib:8.2f}  {note}" for what, gib, note in self.rows]
        lines.append(f"  {'total (estimate)':26s} {self.total_gib:8.2f}"
                     + (f"  of {self.device_gib:.1f} on the device" if self.device_gib else ""))
        return "\n".join(lines)

    def advice(self) -> str:
        """What to lower, largest item first."""
        hints = {
            "optimizer (fp32 state)": "optim.placement=host moves the 12 bytes per parameter to pinned host memory",
            "layer state pool": "lower engine.max_num_seqs (a state per running request)",
            "KV pool": "lower rollout.max_concurrent_rollouts or rollout.max_new_tokens (the pool is sized from "
                       "them), or set memory.lend_kv=always so the step reuses it",
            "activations (estimate)": "lower step.max_tokens_per_row, or memory.activation_checkpointing=true",
            "logits chunk": "lower step.logprob_chunk",
        }
        ranked = sorted(self.rows, key=lambda r: -r[1])
        return "; ".join(f"{what}: {hints[what]}" for what, _, _ in ranked if what in hints)


def kv_blocks_for(max_concurrent: int, prompt_tokens: int, max_new_tokens: int, block_size: int) -> int:
    """Blocks for ``max_concurrent`` requests of ``prompt_tokens + max_new_tokens`` (group prompts share theirs,
    so this is an upper bound), plus one block of slack per request."""
    per_request = -(-(prompt_tokens + max_new_tokens) // block_size) + 1
    return max_concurrent * per_request


def _frozen_note(model: torch.nn.Module) -> str:
    """Why fewer parameters have gradients than the model has."""
    if is_lora(model):
        return "the LoRA adapters' alone"
    if is_vision_model(model) and not vision_trains(model):
        return "none for the frozen vision tower"
    return "the trainable parameters' alone"


def plan_memory(model: torch.nn.Module, kv_pool_bytes: int, optimizer_on_gpu: bool, lend_kv: bool,
                max_tokens_per_row: int, logprob_chunk: int, activation_checkpointing: bool,
                reference: Literal["none", "device", "host", "adapters_off"] = "none", lora_merged_bytes: int = 0,
                state_pool_bytes: int = 0) -> MemoryPlan:
    """``reference``: where the KL term's frozen copy of the weights lives (``unison.train.reference``; a LoRA
    policy's is its base, no copy). With LoRA adapters only they have gradients and optimizer state.
    ``state_pool_bytes``: a hybrid model's per-request layer states (``unison.engine.state``), lent with the KV."""
    text = model.config.get_text_config()
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(local(p).numel() * p.element_size() for p in params)  # this process's shards
    trainable = sum(local(p).numel() for p in params if p.requires_grad)
    elt = next(iter(params)).element_size()
    hidden, layers = text.hidden_size, text.num_hidden_layers
    inter = getattr(text, "intermediate_size", 4 * hidden)
    heads = getattr(text, "num_attention_heads", None) or 1
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_width = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    # Saved for backward per token per layer, roughly: the layer's inputs and norms, the MLP's gate, up and product,
    # and the attention's q, k, v (and v's copy: unison.train.fused_qk) and output. With checkpointing: the layer
    # input, plus one layer recomputed. The GRPO loop's peak grew by 40.3 KiB (Qwen3-0.6B) and 72.1 KiB (1.7B) a
    # token a layer of longer rows on an H200 (bench/results/h200/speed/rows): 40 and 70 here (30 and 60 without
    # the attention's own widths, which Qwen3's 16 x 128 query and 8 x 128 key/value heads make wider than hidden).
    per_token_layer = elt * (6 * hidden + 3 * inter + heads * head_dim + 3 * kv_width)
    activations = max_tokens_per_row * (layers * (elt * hidden if activation_checkpointing else per_token_layer)
                                        + (per_token_layer if activation_checkpointing else 0))
    gib = 2**30
    lent = kv_pool_bytes + state_pool_bytes
    rows = [("weights (live)", weights / gib, "shared by the engine and the trainer"),
            ("gradients", trainable * elt / gib, _frozen_note(model) if trainable < weights / elt else ""),
            ("optimizer (fp32 state)", (12 * trainable if optimizer_on_gpu else 0) / gib,
             "" if optimizer_on_gpu else f"{12 * trainable / gib:.2f} GiB in pinned host memory"),
            ("KV pool", kv_pool_bytes / gib, "lent to the training step" if lend_kv else ""),
            ("activations (estimate)", (max(activations - lent, 0) if lend_kv else activations) / gib,
             "beyond the lent KV pool" if lend_kv else ""),
            ("logits chunk", 3 * logprob_chunk * text.vocab_size * 4 / gib, "fp32 logits, softmax, grad")]
    if state_pool_bytes:
        rows.insert(4, ("layer state pool", state_pool_bytes / gib, "hybrid layers' conv and recurrent states, "
                        + ("lent with the KV pool" if lend_kv else "per running request")))
    if lora_merged_bytes:
        rows.append(("LoRA merged weights", lora_merged_bytes / 2**30, "the engine's W + s B A (engine.lora_weights)"))
    if reference == "adapters_off":
        rows.append(("reference model", 0.0, "the base, its adapters off or the initial ones (loss.beta > 0)"))
    elif reference != "none":
        rows.append(_reference_row(model, weights, reference == "host"))
    device_gib = None
    device = next(iter(params)).device
    if device.type == "cuda":
        device_gib = torch.cuda.get_device_properties(device).total_memory / gib
    return MemoryPlan(rows, device_gib)


def _reference_row(model: torch.nn.Module, weights: int, on_host: bool) -> tuple[str, float, str]:
    """The reference model: a copy of the weights on the device, or (streamed from pinned host memory) the layers
    outside the decoder stack plus its largest layer."""
    from .reference import decoder_layers  # imported here: reference imports the training step's modules

    gib = 2**30
    if not on_host:
        return ("reference model", weights / gib, "frozen copy of the initial weights (loss.beta > 0)")
    layer_bytes = [sum(local(p).numel() * p.element_size() for p in layer.parameters())
                   for _, layer in decoder_layers(model)]
    on_device = weights - sum(layer_bytes) + max(layer_bytes, default=0)
    return ("reference model", on_device / gib, f"{weights / gib:.2f} GiB in pinned host memory, a layer at a time")


AUTO_ROW_TOKENS = (24576, 16384, 8192, 4096, 2048)
AUTO_DEVICE_FRACTION = 0.85
LEND_FOR_ROWS = 8192
"""The longest rows worth lending the KV pool for: lending costs ~0.15 s a step at 1.7B on an H200
(bench/results/h200/memory.json), rows of 16384 tokens instead of 8192 saved 0.08 s (0.6B) and 0.07 s (1.7B) of
the training step (bench/results/h200/speed/after/train_profile_*.json)."""


def auto_row_tokens(plan_for: Callable[[int], MemoryPlan], longest_sample: int) -> int:
    """The packed row length for ``step.max_tokens_per_row=0``: the longest of ``AUTO_ROW_TOKENS`` whose plan
    (``plan_for(row_tokens)``) fits in 85% of the GPU, and at least ``longest_sample``.

    Longer rows mean fewer, larger micro-batches: a 1.7B model's step over 64 x 576 tokens on an H200 took 2.04 s
    in rows of 4096 tokens, 1.50 s in rows of 8192 and 1.47 s in rows of 16384 (bench/train_profile.py), because
    short rows leave the step bound by kernel launches; with the fused training kernels, 1.02 and 0.95 s (0.63 and
    0.55 s at 0.6B: bench/results/h200/speed). Rows of 32768 gained nothing more once the optimizer
    step took one launch (0.6B: 0.428 s at 16384, 0.435 at 32768; 1.7B: 0.879 and 0.888 s), and the 1.7B loop then
    peaked at 118 of the H200's 139 GiB (bench/results/h200/speed/optimizer). With a row's launches cut to ~800
    (bench/results/cpu/train_launches), longer rows paid again: the 0.6B step took 0.341 s in rows of 16384, 0.316 s
    in rows of 24576 and 0.305 s in one row of 36864; its GRPO loop's training phase 0.35-0.37, 0.32 and 0.31 s, the
    1.7B's 0.73 and 0.69 s at a peak of 89 and 105 GiB (bench/results/h200/speed/rows). Without a GPU the plan has
    no device size: 4096."""
    plans = {tokens: plan_for(tokens) for tokens in AUTO_ROW_TOKENS}
    if plans[AUTO_ROW_TOKENS[0]].device_gib is None:
        return max(4096, longest_sample)
    fits = [t for t, plan in plans.items() if plan.fits(AUTO_DEVICE_FRACTION)]
    return max(fits[0] if fits else AUTO_ROW_TOKENS[-1], longest_sample)


def explain_oom(error: BaseException, plan: MemoryPlan, phase: str) -> RuntimeError:
    return RuntimeError(f"out of GPU memory during {phase}.\n{plan.table()}\nTo fit: {plan.advice()}.\n"
                        f"(the original error: {error})")
