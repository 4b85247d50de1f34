"""The one attention function unison registers with transformers.

A model built with ``attn_implementation="unison"`` runs the stock transformers classes unchanged;
what a forward does depends only on the keyword arguments passed to ``model(...)``:

- ``paged=PagedBatch``: the engine's forward. K/V of the new tokens are written into the engine's
  paged pool, then each sequence attends over its whole context through the engine's backend (an MLA layer
  with a latent cache has written its latent already and attends with absorbed up-projections: ``mla``).
- ``cu_seq_lens_q=(S+1,) int32`` and ``max_length_q=int``: a packed training row (batch 1), causal
  within each segment and never across (varlen attention on the GPU, a per-segment loop on the CPU).
- neither: a plain forward, exactly transformers' SDPA path (padding masks included); layers with logit
  softcapping or attention sinks take transformers' eager math instead (``attention_ops``).

So training and generation share one module tree and one set of parameters, and
``config._attn_implementation`` never changes at run time (it is process-global state).

Engine and packed forwards pass ``attention_mask=NO_MASK``: a 4-D placeholder that transformers'
mask builders return as is, so no O(T^2) mask is materialised for them.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from . import cudnn_attention, mla
from .attention_ops import causal_mask, dense_attention, varlen_attention, varlen_supported

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
    """query: (B, H, T, Dk); key: (B, KVH, T, Dk); value: (B, KVH, T, Dv), after RoPE. Returns ((B, T, H, Dv),
    None). Honours the layer's ``scaling``, ``sliding_window``, ``softcap`` and sinks (``s_aux``)."""
    scale = scaling if scaling is not None else getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = layer_sinks(module, query.shape[1], kwargs.get("s_aux"))
    paged = kwargs.get("paged")
    if paged is not None:
        q = query[0].transpose(0, 1)  # (N, H, D): the engine packs all scheduled tokens into batch 1
        if paged.pool.layers[module.layer_idx].value_in_key:  # an MLA latent cache: the latent is written
            out = mla.attend_absorbed(paged, module, q, scale, window, sinks, softcap)
            return out.unsqueeze(0), None
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        out = paged.attend(module.layer_idx, q, k, v, scale, window, sinks=sinks, softcap=softcap)
        return out.unsqueeze(0), None
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
        if query.shape[0] != 1:
            raise ValueError(f"packed attention expects batch 1, got {query.shape[0]}")
        max_len = int(kwargs.get("max_length_q") or 0)
        # squeeze, not [0]: the same view, but a select's backward zero-fills and copies each gradient (three
        # launches a layer, and the norms' backward then copies the non-contiguous result once more).
        out = varlen_causal(query.squeeze(0).transpose(0, 1), key.squeeze(0).transpose(0, 1),
                            value.squeeze(0).transpose(0, 1), cu_seqlens, max_len, scale, window, sinks=sinks,
                            softcap=softcap)
        return out.unsqueeze(0), None
    if attention_mask is not None and attention_mask.ndim == 4 and attention_mask.shape[-1] == 0:
        raise ValueError("attention_mask=NO_MASK needs engine (paged=) or packed (cu_seq_lens_q=) metadata")
    if sinks is not None or softcap is not None:
        if attention_mask is None:  # transformers skips the mask only where plain causal attention is exact
            attention_mask = causal_mask(key.shape[2], query.shape[2], window, query.device)
        out = dense_attention(query, key, value, scale, attention_mask, softcap=softcap, sinks=sinks)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def layer_sinks(module: torch.nn.Module, heads: int, s_aux: torch.Tensor | None) -> torch.Tensor | None:
    """The layer's attention sinks, (H,), or None: the ``s_aux`` the module passes (GptOss), else a ``sinks``
    tensor it holds (what its eager attention would read)."""
    sinks = s_aux if s_aux is not None else getattr(module, "sinks", None)
    if not isinstance(sinks, torch.Tensor):
        return None
    if sinks.shape != (heads,):
        raise ValueError(f"{type(module).__name__}: attention sinks of shape {tuple(sinks.shape)} for {heads} "
                         f"query heads; unison takes one sink logit per head")
    return sinks


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                  scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """Causal attention within each segment of a packed row.

    q: (T, H, Dk); k: (T, KVH, Dk); v: (T, KVH, Dv); cu_seqlens: (S+1,) int32 with cu_seqlens[-1] == T;
    sinks: (H,) or None. Returns (T, H, Dv). cuDNN's fused attention inside ``cudnn_attention.packed_rows()``
    where it takes the layer, else flash varlen where it can run the layer, else one segment at a time (the CPU,
    fp32, softcapping: O(T_segment^2) memory for the softcapped layers on the GPU).
    """
    if cudnn_attention.runs(q, k, v, window, sinks, softcap):
        out = cudnn_attention.causal(q, k, v, cu_seqlens, max_len, scale)
        if out is not None:
            return out
    if varlen_supported(q, k, v, softcap):
        return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale, window, sinks)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            out[start:end] = causal_attention(q[start:end], k[start:end], v[start:end], scale, window,
                                              sinks=sinks, softcap=softcap)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """One sequence, causal. q: (T, H, Dk); k: (T, KVH, Dk); v: (T, KVH, Dv). Returns (T, H, Dv)."""
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if window is None:
        out = dense_attention(qh, kh, vh, scale, causal=True, softcap=softcap, sinks=sinks)
    else:
        mask = causal_mask(q.shape[0], q.shape[0], window, q.device)
        out = dense_attention(qh, kh, vh, scale, mask, softcap=softcap, sinks=sinks)
    return out.transpose(0, 1)


def register() -> str:
    """Register the function under ``ATTN_NAME`` (idempotent). Plain forwards get SDPA's masks."""
    AttentionInterface.register(ATTN_NAME, unison_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    return ATTN_NAME


register()
