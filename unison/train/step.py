"""One colocated GRPO training step: pack, logprobs, loss, backward, AdamW on fp32 masters (num_iterations times)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..dist.data_parallel import all_reduce_grads, global_sum
from ..dist.tensor_parallel import local_forward
from ..dist.topology import Topology
from ..lora import dropout_active
from ..rollout.advantage import batch_scaled
from ..rollout.sample import Sample
from .logprobs import policy_logprobs, policy_loss, training_kernels
from .loss import LossConfig, MetricAccumulator, grpo_loss, loss_divisor, token_loss
from .optimizer import MasterAdamW
from .packing import pack_samples
from .reference import ReferenceModel


def train_step(model: torch.nn.Module, optimizer: MasterAdamW, samples: list[Sample], loss_cfg: LossConfig,
               temperature: float, max_tokens_per_row: int, pad_id: int, logprob_chunk: int,
               activation_checkpointing: bool = False, topology: Topology | None = None, *,
               reference: ReferenceModel | None = None, num_iterations: int = 1, max_completion_length: int = 0,
               scale_rewards: str = "group", kernels: bool | None = None) -> dict[str, float]:
    """Forward and backward over every packed row (one micro-batch each), then one optimizer step; all of it
    ``num_iterations`` times over the same samples.

    The loss is normalised over the whole step (``loss_cfg.type``: ``unison.train.loss.loss_divisor``), so
    micro-batching does not change the update. The engine is paused simply by not being stepped meanwhile. With
    data-parallel replicas in ``topology`` each trains its own samples: the normalisation counts every replica's
    tokens and sequences and the gradients are summed across replicas once, before the optimizer step, so N replicas
    make the update one process would make on all their samples. With tensor parallelism the forwards run on the
    local shards.

    The first iteration's ratio is against the engine's logprobs; later iterations' PPO ratio is against the
    trainer's logprobs of the first one (before any update), the engine correction then fixed (``grpo_loss``).
    ``reference`` gives the KL term's logprobs (``loss_cfg.beta`` > 0), computed once. ``scale_rewards='batch'``
    divides the samples' (group-centred) advantages by the std of every replica's rewards first.
    ``max_completion_length`` is dr_grpo's constant (``rollout.max_new_tokens``). ``kernels``: the trainer's fused
    Triton kernels (``policy_logprobs``; None: on the GPU), in for the backward too (an activation-checkpointed
    layer's recomputed forward must save what its first forward saved).
    """
    if num_iterations < 1:
        raise ValueError(f"num_iterations must be >= 1, got {num_iterations}")
    if loss_cfg.beta > 0 and reference is None:
        raise ValueError(f"loss.beta={loss_cfg.beta} needs a reference model (unison.train.reference)")
    device = next(model.parameters()).device
    if kernels is None:
        kernels = device.type == "cuda"
    dp_group = topology.dp.group if topology is not None and topology.dp is not None else None
    replicas = topology.dp.world if dp_group is not None else 1
    step_sum = (lambda x: global_sum(x, dp_group, device)) if dp_group is not None else float
    if scale_rewards == "batch":
        samples = _batch_scaled(samples, step_sum)
    trained = [s for s in samples if not (loss_cfg.mask_truncated_completions and s.finish_reason == "length")]
    rows = pack_samples(trained, max_tokens_per_row, pad_id)
    local_tokens = sum(s.num_loss_tokens for s in trained)
    num_loss_tokens = int(step_sum(local_tokens))
    num_sequences = int(step_sum(len(samples)))  # truncated ones masked out still count, as in TRL
    # Everything a row needs on the device before the first forward, and nothing read back until the optimizer
    # step: between micro-batches the host never waits on the GPU (a blocking copy or a read per row used to empty
    # its queue, and the next forward started on an idle GPU).
    seq_lens = [[trained[j].num_loss_tokens for j in row.sample_index] for row in rows]
    divisors = [loss_divisor(loss_cfg.type, lens, num_loss_tokens, num_sequences, local_tokens, replicas,
                             max_completion_length) for lens in seq_lens]
    divisors = [d.to(device) if isinstance(d, torch.Tensor) else d for d in divisors]
    rows = [row.to(device) for row in rows]
    with local_forward(model, topology)():  # a LoRA policy's base, under tensor parallelism on its local shards
        refs = [reference.logprobs(row, temperature or 1.0, logprob_chunk) if reference is not None
                else None for row in rows]
    olds: list[torch.Tensor | None] = [None] * len(rows)
    acc = MetricAccumulator()
    total_loss = torch.zeros((), dtype=torch.float32, device=device)
    for iteration in range(num_iterations):
        # Under tensor parallelism: the local shards with explicit collectives (unison.dist.tensor_parallel).
        with checkpointed_layers(model, activation_checkpointing), local_forward(model, topology)(train=True), \
                dropout_active(model), training_kernels(model, kernels):
            for i, row in enumerate(rows):
                loss, logprobs, entropy, metrics = _row_loss(
                    model, row, loss_cfg, num_loss_tokens, temperature or 1.0, logprob_chunk, kernels,
                    divisor=divisors[i], seq_lens=seq_lens[i], old_logprobs=olds[i], ref_logprobs=refs[i])
                if iteration == 0 and num_iterations > 1:
                    olds[i] = logprobs.detach()
                loss.backward()
                total_loss += loss.detach() / num_iterations
                metrics["policy/entropy_mean"] = entropy.mean()
                acc.add(metrics)
        stats = _optimizer_step(model, optimizer, dp_group, trained_any=bool(rows))
    out = acc.reduce()
    out.pop("tokens")
    out.update({"loss": total_loss.item(), "optim/lr": stats.lr, "optim/grad_norm": stats.grad_norm,
                "optim/changed_frac": stats.changed_fraction, "train/rows": float(len(rows)),
                "train/loss_tokens": float(local_tokens), "train/samples": float(len(samples)),
                "train/tokens": float(sum(s.num_tokens for s in samples))})
    if loss_cfg.mask_truncated_completions:
        out["train/masked_truncated"] = float(len(samples) - len(trained))
    if num_iterations > 1:
        out["train/iterations"] = float(num_iterations)
    return out


def _row_loss(model: torch.nn.Module, row, loss_cfg: LossConfig, num_loss_tokens: int, temperature: float,
              logprob_chunk: int, kernels: bool, *, seq_lens: list[int], **loss_args):
    """One packed row's (loss, logprobs, entropy, metrics). A loss that is a sum over tokens takes the lm_head's
    gradient in its forward, chunk by chunk (``policy_loss``); gspo's ratio is a sequence's mean, so its backward
    recomputes the logits."""
    at = row.loss_positions
    engine_logprobs, advantages = row.engine_logprobs.index_select(0, at), row.advantages.index_select(0, at)
    share = token_loss(engine_logprobs, advantages, loss_cfg, num_loss_tokens, **loss_args)
    if share is not None:
        loss, logprobs, entropy = policy_loss(model, row, share, temperature=temperature, chunk_size=logprob_chunk,
                                              with_entropy=True, kernels=kernels)
        _, metrics = grpo_loss(logprobs, engine_logprobs, advantages, loss_cfg, num_loss_tokens, seq_lens=seq_lens,
                               read_metrics=False, **loss_args)
    else:
        logprobs, entropy = policy_logprobs(model, row, temperature=temperature, chunk_size=logprob_chunk,
                                            with_entropy=True, kernels=kernels)
        loss, metrics = grpo_loss(logprobs, engine_logprobs, advantages, loss_cfg, num_loss_tokens,
                                  seq_lens=seq_lens, read_metrics=False, **loss_args)
    return loss, logprobs, entropy, metrics


def _optimizer_step(model: torch.nn.Module, optimizer: MasterAdamW, dp_group, trained_any: bool):
    """Sum the gradients across replicas (if any), step, clear them."""
    if dp_group is not None or not trained_any:
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:  # a replica that trained no row this step still adds its (zero) gradient
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if dp_group is not None:
            all_reduce_grads(params, dp_group)
    stats = optimizer.step()
    optimizer.zero_grad()
    return stats


def _batch_scaled(samples: list[Sample], step_sum) -> list[Sample]:
    """The samples with their advantages divided by the std of the step's rewards (``scale_rewards='batch'``)."""
    rewards = [s.reward for s in samples]
    total, squares = step_sum(math.fsum(rewards)), step_sum(math.fsum(r * r for r in rewards))
    count = step_sum(len(rewards))
    if count < 1:
        return samples
    scaled = batch_scaled([s.advantage for s in samples], total, squares, int(count))
    return [dataclasses.replace(s, advantage=a) for s, a in zip(samples, scaled, strict=True)]


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
