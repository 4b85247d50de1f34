"""The vocabulary projection both the engine and the trainer use, so their logprobs agree.

bf16 operands, fp32 output. Rounding the logits themselves to bf16 (what ``model.lm_head`` returns) moves
each by up to half a bf16 step, 0.03 at |logit| ~ 8: on the H200 with SmolLM2-135M at lr 0 that alone made
the engine's and the trainer's logprobs differ by 4e-2 nats on average (bench/results/h200/train_gpu).
"""

from __future__ import annotations

import torch


def lm_head_fp32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden: (N, H); weight: (V, H), same dtype. Returns (N, V) float32 = hidden @ weight.T, accumulated and
    returned in fp32 without materialising an fp32 copy of the weight on the GPU."""
    if weight.dtype == torch.float32:
        return hidden.float() @ weight.T
    if hidden.is_cuda:
        return torch.mm(hidden, weight.T, out_dtype=torch.float32)
    return hidden.float() @ weight.float().T


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The base model that returns final hidden states (``model.model`` for Llama, Qwen3, ...)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        decoder = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if decoder is None or decoder is model:
        raise ValueError(f"cannot find the decoder of {type(model).__name__}")
    return decoder


def check_plain_lm_head(model: torch.nn.Module) -> None:
    """The chunked lm_head computes hidden @ W.T only; refuse heads that would make it silently wrong."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(model).__name__}: unison needs a bias-free linear lm_head")
    config = getattr(model, "config", None)
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise ValueError(f"{type(model).__name__}: final_logit_softcapping is not supported")
    if getattr(config, "logits_scaling", 1.0) != 1.0 or getattr(config, "logit_scale", 1.0) != 1.0:
        raise ValueError(f"{type(model).__name__}: scaled output logits are not supported")
