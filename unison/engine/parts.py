"""What an ``Engine`` derives from its model and config: its forwards (local shards, a LoRA policy's merged weights,
MoE experts' kernels), the hybrid layers' state pool, the kernels, the eos ids; the checks every request passes
before it is queued; and the rows a step's forked requests sample from."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..dist.tensor_parallel import local_forward
from ..dist.topology import Topology
from ..lora import MergedAdapters, engine_merges, is_lora
from . import moe, state
from .attention import ATTN_NAME
from .cache import BlockAllocator, KVPool
from .scheduler import Request, Scheduler
from .types import EngineConfig, SamplingParams

log = logging.getLogger(__name__)

def engine_forward(model: torch.nn.Module, config: EngineConfig, device: torch.device, topology: Topology | None
                   ) -> tuple[object, MergedAdapters | None]:
    """The context the engine's forwards run in, and a LoRA policy's merged adapters (or None).

    Under tensor parallelism the forwards run on the local shards with explicit all-reduces, not through DTensor
    dispatch. A LoRA policy's adapters are PEFT's unmerged layers, or merged copies of the adapted weights for the
    engine (``config.lora_weights``). MoE experts run unison's kernels in the engine's forwards only (prefill and the
    captured decode step); training keeps transformers'. Switches the model to unison's attention function first."""
    if model.config._attn_implementation != ATTN_NAME:
        # Once, before the engine's first forward; the unison function serves plain forwards exactly as
        # SDPA does, so other users of the model see no change. Never switched back and forth.
        log.info("switching %s to the %r attention implementation", type(model).__name__, ATTN_NAME)
        model.set_attn_implementation(ATTN_NAME)
    forward = local_forward(model, topology)
    tp = topology.tp_size if topology is not None else 1
    merged = MergedAdapters(model) if is_lora(model) and engine_merges(
        config.lora_weights, model, device, tensor_parallel=tp > 1) else None
    if merged is not None:
        forward = WithMerged(forward, merged)
    experts = moe.kernel_modules(model) if config.moe_kernel == "triton" else []
    if experts:
        forward = moe.WithExpertsKernels(forward, experts)
    return forward, merged


def snapshot_slots(config: EngineConfig) -> int:
    """State slots for shared prompts (one per group a hybrid model's samples fork from), beside one per request."""
    return config.max_num_seqs // 4 + 1 if config.prefix_caching else 0


def scheduler_for(config: EngineConfig, allocator: BlockAllocator, hybrid: bool, graphs: bool) -> Scheduler:
    """The engine's scheduler; a hybrid model's with a state slot per request and the shared prompts'. New prefill
    work is held (``config.prefill_wait_steps``) only where decode steps run as CUDA graphs (``graphs``)."""
    return Scheduler(allocator, config.block_size, config.max_batch_tokens, config.max_num_seqs, config.prefix_caching,
                     state_slots=config.max_num_seqs if hybrid else 0, snapshot_slots=snapshot_slots(config) if hybrid
                     else 0, prefill_wait=config.prefill_wait_steps if graphs else 0)


def state_pool(model: torch.nn.Module, pool: KVPool, max_num_seqs: int, device: torch.device,
                tp: int) -> state.StatePool | None:
    """The per-request state pool of a hybrid model's sequence layers (None for a model without them): a slot per
    running request, the shared prompts' and a scratch slot. Refuses layers without attention and without state."""
    layers = state.install(model)
    covered = {s.layer_idx for s in layers}
    bare = [i for i, kv in enumerate(pool.layers) if kv.kv_heads == 0 and i not in covered]
    if bare:
        raise ValueError(f"{type(model).__name__}: layers {bare} keep no KV and are no sequence layer unison's "
                         f"engine knows (unison.engine.state); it cannot generate from this model")
    if not layers:
        return None
    if tp > 1:
        raise ValueError(f"{type(model).__name__}: hybrid models (conv / linear-attention / state-space layers) "
                         f"run without tensor parallelism for now")
    return state.StatePool(layers, max_num_seqs + 1, device)


def resolve_kernels(choice: str, device: torch.device) -> str:
    """``EngineConfig.attention`` made concrete: "triton" (the Triton attention and fused sampler) or "torch"."""
    if choice == "auto":
        return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"
    return choice


def eos_ids(model: torch.nn.Module) -> list[int]:
    """Every eos id the model declares (generation config and config; some models end turns on several)."""
    ids: list[int] = []
    for cfg in (getattr(model, "generation_config", None), model.config):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        for t in [eos] if isinstance(eos, int) else (eos or []):
            if t not in ids:
                ids.append(int(t))
    return ids


class WithMerged:
    """The engine's forward context (``local``'s) with a LoRA policy's merged weights switched in."""

    def __init__(self, local, merged: MergedAdapters):
        self.local, self.merged = local, merged
        self.heartbeat = getattr(local, "heartbeat", None)

    @contextmanager
    def __call__(self, train: bool = False) -> Iterator[int]:
        with self.local(train=train) as value, self.merged.active():
            yield value


def check_request(prompt: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  config: EngineConfig, has_tokenizer: bool) -> None:
    """Raise ValueError, naming what is wrong, for a request the engine cannot run: an empty prompt, token ids
    outside the vocabulary, no room left in the context, stop strings without a tokenizer, more KV than the pool."""
    if not prompt:
        raise ValueError("empty prompt: a request needs at least one prompt token")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(prompt) >= max_model_len:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the context of {max_model_len} tokens")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need the tokenizer: build the engine with Engine(..., tokenizer=...)")
    for t in params.stop_token_ids or ():
        if not 0 <= t < vocab_size:
            raise ValueError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})")
    tokens = min(len(prompt) + params.max_new_tokens, max_model_len)
    blocks = -(-tokens // config.block_size)
    if blocks > config.num_blocks:
        raise ValueError(f"a request of up to {tokens} tokens needs {blocks} KV blocks but the pool has "
                         f"{config.num_blocks}: raise EngineConfig.num_blocks or lower max_new_tokens")


def fork_rows(forks: list[tuple[Request, Request]], logits: torch.Tensor, sampling: list[Request], pool: KVPool,
              block_size: int) -> tuple[torch.Tensor, list[Request]]:
    """The step's forks (``Scheduler.take_forks``: a request, and the one that computed its prompt this step): each
    copies the prompt's partial last block from the other and samples from its logits row. Returns the logits and
    the sampling requests with the forks' rows appended."""
    src, dst = [], []
    for req, lead in forks:
        full, partial = divmod(len(req.prompt), block_size)
        if partial:
            src += range(lead.blocks[full] * block_size, lead.blocks[full] * block_size + partial)
            dst += range(req.blocks[full] * block_size, req.blocks[full] * block_size + partial)
    if src:
        pool.copy_slots(torch.tensor(src, device=logits.device), torch.tensor(dst, device=logits.device))
    row = {id(r): i for i, r in enumerate(sampling)}
    rows = torch.tensor([row[id(lead)] for _, lead in forks], device=logits.device)
    return torch.cat([logits, logits.index_select(0, rows)]), sampling + [req for req, _ in forks]


def uncut(params: SamplingParams) -> bool:
    """No top-k, top-p or min-p cut: the fused sampler's rows."""
    return params.top_k == 0 and params.top_p == 1 and params.min_p == 0
