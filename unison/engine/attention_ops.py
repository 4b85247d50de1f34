"""Attention math shared by the attention function (training, plain forwards) and the paged backends (engine).

Every layer is described by its scale, its sliding window, and the two features some families add to the
softmax, each exactly as transformers' eager attention applies it:

- attention logit softcapping (Gemma2): ``scores = softcap * tanh(scores / softcap)`` before the mask;
- attention sinks (GptOss): one learned logit per query head joins every row's softmax and is dropped after
  it, so a row's weights sum to ``sigmoid(lse - sink)`` instead of one.

``dense_attention`` serves explicit keys under a visibility mask (SDPA for plain layers, the eager math for
the others); ``varlen_attention`` serves packed segments through torch's flash varlen kernel (bf16/fp16 on
CUDA), with sinks through the exact log-sum-exp correction and its exact gradient. Flash cannot softcap:
``varlen_supported`` says when a caller must take ``dense_attention`` instead.

Keys and values may differ in width (MLA: keys ``qk_nope + qk_rope`` wide, values ``v_head_dim``); outputs
take the value width.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F


def _load_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None, {}
    gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    return varlen_attn, gqa


torch_varlen_attn, VARLEN_GQA_KW = _load_varlen()
"""torch's flash varlen attention (None before torch 2.9), and the keyword that lets it take fewer KV heads."""

_MAX_FLASH_DIM = 256


def varlen_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None) -> bool:
    """Whether ``varlen_attention`` can run this layer: CUDA, bf16/fp16, no softcapping, widths flash takes."""
    return (torch_varlen_attn is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)
            and softcap is None and _flash_width(q, v) <= _MAX_FLASH_DIM)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed query segments over packed key segments, bottom-right aligned (a segment's
    last query sees its last key). Differentiable w.r.t. q, k, v and sinks.

    q: (Tq, H, Dk); k: (Tk, KVH, Dk); v: (Tk, KVH, Dv); cu_q, cu_k: (S+1,) int32; sinks: (H,) or None.
    Returns (Tq, H, Dv) in q's dtype. Check ``varlen_supported`` first.
    """
    width, dv = _flash_width(q, v), v.shape[-1]
    # Flash wants one head width for q, k and v: zero columns change no score and add nothing to the output.
    q, k, v = (_pad_last(t, width) for t in (q, k, v))
    window_size = (-1, 0) if window is None else (window - 1, 0)
    if sinks is None and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        # No gradient wanted (the engine's prefill): flash's forward itself. torch's varlen_attn makes the same call
        # behind a custom operator's dispatch, a log line and an rng-state allocation: host time an eager prefill
        # step is short of (bench/results/h200/speed/prefill).
        out = _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size)[0]
    elif sinks is None:
        out = _Flash.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size)
    else:
        out = _FlashWithSinks.apply(q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, window_size)
    return out[..., :dv] if width != dv else out


class _Flash(torch.autograd.Function):
    """Flash varlen attention, differentiable: flash's forward and backward, the calls torch's ``varlen_attn``
    makes (the same kernels and bits, ``tests/test_triton_gpu.py``), without its custom operator's dispatch,
    log lines and rng-state allocation. That wrapping took ~0.25 ms of host time a layer per forward and backward
    (cProfile of a 0.6B training step on the H200 host), and the first packed row's forward was host-bound."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size):
        out, lse, rng_state = _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state)
        ctx.args = (max_q, max_k, scale, window_size)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, cu_q, cu_k, rng_state = ctx.saved_tensors
        dq, dk, dv = _flash_backward(grad, q, k, v, out, lse, cu_q, cu_k, rng_state, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


class _FlashWithSinks(torch.autograd.Function):
    """Flash varlen attention with attention sinks.

    Forward: flash's output ``o`` and log-sum-exp ``lse`` of each (query, head), then ``y = o * exp(lse - L)``
    with ``L = logaddexp(lse, sink)``: the output of the softmax that includes the sink. Backward: flash's own
    backward given ``y`` as the output and ``L`` as the log-sum-exp recomputes the sink-including probabilities
    ``exp(s - L)`` and ``D = rowsum(dy * y)``, which is exactly the gradient of the sink softmax w.r.t. q, k, v;
    the sinks get ``-sum over queries of rowsum(dy * y) * exp(sink - L)``. (torch's varlen autograd drops any
    gradient that reaches its lse, so correcting its output outside would lose the lse's part.)
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q, max_k, scale, window_size):
        out, lse, rng_state = _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size)
        lse = _lse_heads_first(lse, q)
        total = torch.logaddexp(lse, sinks.float()[:, None])  # (H, Tq)
        y = (out.float() * torch.exp(lse - total).T[:, :, None]).to(out.dtype)
        ctx.save_for_backward(q, k, v, y, total, sinks, cu_q, cu_k, rng_state)
        ctx.args = (max_q, max_k, scale, window_size)
        return y

    @staticmethod
    def backward(ctx, grad):
        q, k, v, y, total, sinks, cu_q, cu_k, rng_state = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = _flash_backward(grad, q, k, v, y, total, cu_q, cu_k, rng_state, *ctx.args)
        row = (grad.float() * y.float()).sum(-1)  # (Tq, H)
        dsinks = -(row * torch.exp(sinks.float()[:, None] - total).T).sum(0)
        return dq, dk, dv, dsinks.to(sinks.dtype), None, None, None, None, None, None


def _flash_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, window_size: tuple[int, int]):
    """Flash's varlen forward: (out, log-sum-exp, rng state). Causal where the window is (-1, 0)."""
    out, lse, rng_state, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, window_size == (-1, 0), False, scale=scale,
        window_size_left=window_size[0], window_size_right=window_size[1])
    return out, lse, rng_state


def _flash_backward(grad, q, k, v, out, lse, cu_q, cu_k, rng_state, max_q: int, max_k: int, scale: float,
                    window_size: tuple[int, int]):
    """Flash's varlen backward given the forward's output and log-sum-exp: (dq, dk, dv)."""
    return torch.ops.aten._flash_attention_backward(
        grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, window_size == (-1, 0), rng_state,
        torch.empty(0, device=q.device), scale=scale, window_size_left=window_size[0],
        window_size_right=window_size[1])


def _lse_heads_first(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Flash's varlen log-sum-exp as (H, Tq) fp32 contiguous."""
    tq, heads = q.shape[0], q.shape[1]
    if lse.shape == (heads, tq):
        return lse.float().contiguous()
    if lse.shape == (tq, heads):
        return lse.float().T.contiguous()
    raise RuntimeError(f"flash varlen returned a log-sum-exp of shape {tuple(lse.shape)} for {tq} queries of "
                       f"{heads} heads")


def _flash_width(q: torch.Tensor, v: torch.Tensor) -> int:
    width = max(q.shape[-1], v.shape[-1])
    return -(-width // 8) * 8


def _pad_last(t: torch.Tensor, width: int) -> torch.Tensor:
    return t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    mask: torch.Tensor | None = None, causal: bool = False, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of explicit queries over explicit keys, differentiable.

    q: (..., H, Tq, Dk); k: (..., KVH, Tk, Dk); v: (..., KVH, Tk, Dv); mask: None, bool (True: visible) or
    additive float, broadcastable to (..., H, Tq, Tk); ``causal``: query i sees keys up to Tk - Tq + i (with
    ``mask`` None); sinks: (H,). Returns (..., H, Tq, Dv). Plain layers run SDPA; softcapped or sink layers
    run transformers' eager math, with the softmax in fp32.
    """
    gqa = q.shape[-3] != k.shape[-3]
    if softcap is None and sinks is None:
        if causal and q.shape[-2] != k.shape[-2]:
            mask, causal = causal_mask(k.shape[-2], q.shape[-2], None, q.device), False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = causal_mask(k.shape[-2], q.shape[-2], None, q.device)
    if mask is not None:
        # The eager models' additive minimum, not -inf: a row that sees no key stays finite (as in eager).
        scores = (scores.masked_fill(~mask, torch.finfo(torch.float32).min) if mask.dtype == torch.bool
                  else scores + mask)
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.matmul(probs.to(v.dtype), v)


def causal_mask(num_keys: int, num_queries: int, window: int | None, device: torch.device) -> torch.Tensor:
    """(Tq, Tk) bool, True where visible: the queries are the last ``num_queries`` positions of the keys'."""
    keys = torch.arange(num_keys, device=device)
    queries = torch.arange(num_keys - num_queries, num_keys, device=device)
    return key_visible(keys[None, :], queries[:, None], window)


def key_visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility; padded keys carry position -1 and are never visible."""
    mask = (key_pos >= 0) & (key_pos <= query_pos)
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask
