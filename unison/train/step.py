"""One colocated GRPO optimizer step: pack, logprobs, loss, backward, AdamW on fp32 masters."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..dist.data_parallel import all_reduce_grads, global_sum
from ..dist.tensor_parallel import local_forward
from ..dist.topology import Topology
from ..engine.attention import ATTN_NAME, NO_MASK
from ..engine.lm_head import decoder_of
from ..rollout.sample import Sample
from .logprobs import policy_logprobs
from .loss import LossConfig, MetricAccumulator, grpo_loss
from .optimizer import MasterAdamW
from .packing import pack_samples


def train_step(model: torch.nn.Module, optimizer: MasterAdamW, samples: list[Sample], loss_cfg: LossConfig,
               temperature: float, max_tokens_per_row: int, pad_id: int, logprob_chunk: int,
               activation_checkpointing: bool = False, topology: Topology | None = None) -> dict[str, float]:
    """Forward and backward over every packed row (one micro-batch each), then one optimizer step.

    The loss is normalised by the completion tokens of the whole step, so micro-batching does not change the
    update. The engine is paused simply by not being stepped meanwhile. With data-parallel replicas in
    ``topology`` each trains its own samples: the normalisation counts every replica's tokens and the gradients
    are summed across replicas once, before the optimizer step, so N replicas make the update one process would
    make on all their samples. With tensor parallelism the forwards run on the local shards.
    """
    device = next(model.parameters()).device
    dp_group = topology.dp.group if topology is not None and topology.dp is not None else None
    rows = pack_samples(samples, max_tokens_per_row, pad_id)
    local_tokens = sum(len(s.completion_ids) for s in samples)
    num_loss_tokens = int(global_sum(local_tokens, dp_group, device)) if dp_group is not None else local_tokens
    acc = MetricAccumulator()
    total_loss = 0.0
    # Under tensor parallelism: the local shards with explicit collectives (unison.dist.tensor_parallel).
    with checkpointed_layers(model, activation_checkpointing), local_forward(model, topology)(train=True):
        for row in rows:
            row = row.to(device)
            logprobs, _ = policy_logprobs(model, row, temperature=temperature or 1.0, chunk_size=logprob_chunk)
            mask = row.loss_mask
            loss, metrics = grpo_loss(logprobs, row.engine_logprobs[mask], row.advantages[mask], loss_cfg,
                                      num_loss_tokens)
            loss.backward()
            total_loss += loss.item()
            acc.add(metrics)
    if dp_group is not None:
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # a replica that trained no row this step still adds its (zero) gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_grads(params, dp_group)
    stats = optimizer.step()
    optimizer.zero_grad()
    out = acc.reduce()
    out.pop("tokens")
    out.update({"loss": total_loss, "optim/lr": stats.lr, "optim/grad_norm": stats.grad_norm,
                "optim/changed_frac": stats.changed_fraction, "train/rows": float(len(rows)),
                "train/loss_tokens": float(local_tokens), "train/samples": float(len(samples)),
                "train/tokens": float(sum(s.num_tokens for s in samples))})
    return out


@contextmanager
def checkpointed_layers(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Activation checkpointing of every decoder layer for the block. transformers checkpoints a layer only in
    training mode; only the layers themselves are flagged as training, so dropout inside them (and every other
    module) stays as the model was: the trainer's forward computes the same function as the engine's."""
    if not enabled:
        yield
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.24 (the older names warn there)
        if not model.is_activation_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif not model.is_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    modes = [m.training for m in layers]
    for m in layers:
        m.training = True
    try:
        yield
    finally:
        for m, mode in zip(layers, modes, strict=True):
            m.training = mode


@torch.no_grad()
def check_packed_attention(model: torch.nn.Module) -> None:
    """Refuse an attention implementation that lets packed samples see each other.

    Runs one packed row of two short segments and compares the second segment's hidden states with a forward
    of that segment alone: any leak across the boundary changes them.
    """
    impl = model.config._attn_implementation
    if impl != ATTN_NAME:
        raise ValueError(f"packed training needs attn_implementation={ATTN_NAME!r}; the model uses {impl!r}, which "
                         "would let packed samples attend to each other")
    device = next(model.parameters()).device
    decoder = decoder_of(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (1, 12), generator=g).to(device)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None].to(device)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    packed = decoder(input_ids=ids, position_ids=pos, attention_mask=NO_MASK, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                     max_length_q=7, max_length_k=7, use_cache=False).last_hidden_state[0, 5:].float()
    alone = decoder(input_ids=ids[:, 5:], use_cache=False).last_hidden_state[0].float()
    err = ((packed - alone).norm() / alone.norm()).item()
    if not err < 2e-2:  # bf16 kernels differ by ~1e-3; a leak changes the states by O(1)
        raise RuntimeError(f"packed attention leaks across samples (relative difference {err:.3g})")
