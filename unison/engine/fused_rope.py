"""Rotary position embedding of q and k in one kernel for the engine's captured decode step.

transformers applies RoPE as ``q * cos + rotate_half(q) * sin`` and the same for k: per layer a negation, a
concatenation, four multiplications and two additions, ten kernels of a few microseconds each on a few
kilobytes. In a 28-layer decode step that is ~280 launches, about 0.7 ms of the 5.0 ms step of a 1.7B model at 64
sequences on an H200 (bench/results/h200/engine_profile_1.7b_64.json).
``fused_rope(model)`` makes the model's modeling module call one Triton kernel for both instead, for the
duration of a ``with`` block (the engine captures its decode graphs inside it). The kernel computes the same
function: each product rounded to the input dtype, then the sum. On an H200 ~76% of elements come out with the
same bits as transformers' and the rest one rounding step away, in fp32 too, which points at the compiler
contracting a multiply into the add (tests/test_triton_gpu.py prints the fraction); the engine's logprobs stay at
the bf16 floor (tests/test_engine_gpu.py).

The swap replaces the module-level ``apply_rotary_pos_emb`` of the known model families' modeling modules,
the function their attention forward calls; it is process-global while the block runs, which is safe because
the engine and the trainer are stepped from one thread. Anything the kernel does not cover (a partial rotary
dimension, another ``unsqueeze_dim``, a non-contiguous head dimension) falls through to transformers' own.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

ATTENTION_CLASSES = {"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "MistralAttention",
                     "Qwen3MoeAttention"}  # Qwen3-MoE's attention and apply_rotary_pos_emb are Qwen3's


@triton.jit(do_not_specialize=["n_tokens", "sq_b", "sk_b", "sc_b"])  # a training row's length: no variant per row
def _rope_kernel(Q, K, QO, KO, Cos, Sin, n_tokens, q_heads, k_heads,
                 sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sc_b, sc_t,
                 HALF: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr, BACKWARD: tl.constexpr = False):
    """One (batch, token) and HEADS of its heads (query heads first, then key heads)."""
    bt = tl.program_id(0).to(tl.int64)
    b, t = bt // n_tokens, bt % n_tokens
    head = (tl.program_id(1) * HEADS + tl.arange(0, HEADS))[:, None].to(tl.int64)
    d = tl.arange(0, BLOCK)[None, :]
    mask = (d < 2 * HALF) & (head < q_heads + k_heads)
    first = d < HALF
    partner = tl.where(first, d + HALF, d - HALF)
    is_q = head < q_heads
    q_off = b * sq_b + head * sq_h + t * sq_t
    k_off = b * sk_b + (head - q_heads) * sk_h + t * sk_t
    src_q, src_k = Q + q_off, K + k_off
    x = tl.where(is_q, tl.load(src_q + d, mask=mask & is_q, other=0.0),
                 tl.load(src_k + d, mask=mask & ~is_q, other=0.0))
    other = tl.where(is_q, tl.load(src_q + partner, mask=mask & is_q, other=0.0),
                     tl.load(src_k + partner, mask=mask & ~is_q, other=0.0))
    cos = tl.load(Cos + b * sc_b + t * sc_t + d, mask=d < 2 * HALF, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose: dx1 = dy1 * cos1 + dy2 * sin2, dx2 = dy2 * cos2 - dy1 * sin1
        rotated = tl.where(first, other.to(tl.float32), -other.to(tl.float32))
        sin = tl.load(Sin + b * sc_b + t * sc_t + partner, mask=d < 2 * HALF, other=0.0).to(tl.float32)
    else:
        rotated = tl.where(first, -other.to(tl.float32), other.to(tl.float32))  # rotate_half: cat(-x2, x1)
        sin = tl.load(Sin + b * sc_b + t * sc_t + d, mask=d < 2 * HALF, other=0.0).to(tl.float32)
    # transformers' rounding: (x * cos) and (rotate_half(x) * sin) each in the tensor dtype, then their sum (the
    # launch turns off multiply-add contraction, which would skip a rounding).
    a = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
    r = (rotated * sin).to(x.dtype).to(tl.float32)
    out = (a + r).to(x.dtype)
    tl.store(QO + q_off + d, out, mask=mask & is_q)
    tl.store(KO + k_off + d, out, mask=mask & ~is_q)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool = False,
         heads_per_program: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (B, H, T, D), k: (B, KVH, T, D), any strides with a contiguous last dimension; cos, sin: (B or 1, T, D)
    with a contiguous last dimension. Returns (q_embed, k_embed), each laid out like its input; with ``backward``,
    the gradients w.r.t. q and k of that function given q and k as the gradients of its outputs."""
    bsz, heads, tokens, dim = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    sc_b = cos.stride(0) if cos.shape[0] > 1 else 0
    total = heads + k.shape[1]
    per_program = min(triton.next_power_of_2(total), heads_per_program)
    _rope_kernel[(bsz * tokens, triton.cdiv(total, per_program))](
        q, k, q_out, k_out, cos, sin, tokens, heads, k.shape[1],
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), sc_b, cos.stride(1),
        HALF=dim // 2, BLOCK=triton.next_power_of_2(dim), HEADS=per_program, BACKWARD=backward,
        num_warps=1 if per_program * dim <= 512 else 4, enable_fp_fusion=False)
    return q_out, k_out


def _covered(q, k, cos, sin, unsqueeze_dim) -> bool:
    if unsqueeze_dim != 1 or q.ndim != 4 or k.ndim != 4 or cos.ndim != 3 or sin.shape != cos.shape:
        return False
    bsz, _, tokens, dim = q.shape
    return (dim % 2 == 0 and k.shape[0] == bsz and k.shape[2:] == q.shape[2:] and cos.shape[1:] == (tokens, dim)
            and cos.shape[0] in (1, bsz) and q.dtype == k.dtype == cos.dtype == sin.dtype
            and q.device == k.device == cos.device == sin.device and cos.stride() == sin.stride()
            and q.stride(-1) == k.stride(-1) == cos.stride(-1) == 1)


@contextmanager
def fused_rope(model: torch.nn.Module, apply=None, modules: list[torch.nn.Module] | None = None):
    """Within the block, the attention of every known class in ``model`` applies RoPE with one kernel,
    ``apply(q, k, cos, sin)``: this module's ``rope`` (looked up on entry) unless given (the trainer passes its
    differentiable one, ``unison.train.fused.rope``). Yields the number of modeling modules switched."""
    apply = apply or rope
    modeling = {sys.modules[type(m).__module__] for m in (model.modules() if modules is None else modules)
                if type(m).__name__ in ATTENTION_CLASSES}
    originals = [(mod, mod.apply_rotary_pos_emb) for mod in modeling if hasattr(mod, "apply_rotary_pos_emb")]
    for mod, original in originals:
        mod.apply_rotary_pos_emb = _fused(original, apply)
    try:
        yield len(originals)
    finally:
        for mod, original in originals:
            mod.apply_rotary_pos_emb = original


def _fused(original, apply):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _covered(q, k, cos, sin, unsqueeze_dim):
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return apply(q, k, cos, sin)
    return apply_rotary_pos_emb
