"""The one attention function unison registers with transformers.

A model built with ``attn_implementation="unison"`` runs the stock transformers classes unchanged;
what a forward does depends only on the keyword arguments passed to ``model(...)``:

- ``paged=PagedBatch``: the engine's forward. K/V of the new tokens are written into the engine's
  paged pool, then each sequence attends over its whole context through the engine's backend.
- ``cu_seq_lens_q=(S+1,) int32`` and ``max_length_q=int``: a packed training row (batch 1), causal
  within each segment and never across (varlen attention on the GPU, a per-segment loop on the CPU).
- neither: a plain forward, exactly transformers' SDPA path (padding masks included).

So training and generation share one module tree and one set of parameters, and
``config._attn_implementation`` never changes at run time (it is process-global state).

Engine and packed forwards pass ``attention_mask=NO_MASK``: a 4-D placeholder that transformers'
mask builders return as is, so no O(T^2) mask is materialised for them.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTN_NAME = "unison"

# A 4-D tensor makes transformers' mask creation return early (masking_utils._preprocess_mask_arguments).
NO_MASK = torch.empty(1, 1, 0, 0, dtype=torch.bool)


def unison_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query: (B, H, T, D); key, value: (B, KVH, T, D), after RoPE. Returns ((B, T, H, D), None)."""
    if kwargs.get("softcap") is not None:
        raise ValueError("unison attention does not support attention logit softcapping")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    paged = kwargs.get("paged")
    if paged is not None:
        q = query[0].transpose(0, 1)  # (N, H, D): the engine packs all scheduled tokens into batch 1
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        out = paged.attend(module.layer_idx, q, k, v, scale, window)
        return out.unsqueeze(0), None
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
        if query.shape[0] != 1:
            raise ValueError(f"packed attention expects batch 1, got {query.shape[0]}")
        max_len = int(kwargs.get("max_length_q") or 0)
        out = varlen_causal(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
                            cu_seqlens, max_len, scale, window)
        return out.unsqueeze(0), None
    if attention_mask is not None and attention_mask.ndim == 4 and attention_mask.shape[-1] == 0:
        raise ValueError("attention_mask=NO_MASK needs engine (paged=) or packed (cu_seq_lens_q=) metadata")
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                  scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention within each segment of a packed row.

    q: (T, H, D); k, v: (T, KVH, D); cu_seqlens: (S+1,) int32 with cu_seqlens[-1] == T. Returns (T, H, D).
    """
    if q.is_cuda and window is None and _varlen_attn is not None:
        return _varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
                            window_size=(-1, 0), **_GQA_KW)
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            out[start:end] = causal_sdpa(q[start:end], k[start:end], v[start:end], scale, window)
    return out


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                window: int | None = None) -> torch.Tensor:
    """One sequence, causal. q: (T, H, D); k, v: (T, KVH, D). Returns (T, H, D)."""
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    gqa = q.shape[1] != k.shape[1]
    if window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        pos = torch.arange(q.shape[0], device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)


def _load_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None, {}
    gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    return varlen_attn, gqa


_varlen_attn, _GQA_KW = _load_varlen()


def register() -> str:
    """Register the function under ``ATTN_NAME`` (idempotent). Plain forwards get SDPA's masks."""
    AttentionInterface.register(ATTN_NAME, unison_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME


register()
