"""The chunked lm_head's per-token reductions in one pass over each fp32 logits chunk (``unison.train.logprobs``).

A chunk's logits are [1024, vocab] fp32: 622 MB at Qwen3's 152k vocabulary, 36 chunks for a 64 x 512-token step.
PyTorch's log-sum-exp, target gather and entropy read and write that block about six times in the forward, and
the backward's softmax, scatter, scale and downcast as many again. Here the forward reads it once (an online
log-sum-exp that carries the entropy's sum along, every term relative to the running maximum, so nothing cancels
at large logits) and the backward reads it once and writes the bf16 gradient of the raw logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG = tl.constexpr(-1.0e30)  # a lane that has seen no logit yet: finite, so no inf - inf


@triton.jit
def _forward_kernel(Z, TARGETS, LSE, LOGP, ENTROPY, stride_z, V, BLOCK: tl.constexpr, WITH_ENTROPY: tl.constexpr):
    """One row: lse = logsumexp(z), logp = z[target] - lse, entropy = -sum(p * log p)."""
    row = tl.program_id(0).to(tl.int64)
    base = Z + row * stride_z
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], _NEG, tl.float32)  # per lane: running max, sum of exp(z - m), sum of exp(z - m) * (z - m)
    s = tl.zeros([BLOCK], tl.float32)
    t = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        mask = start + cols < V
        z = tl.load(base + start + cols, mask=mask, other=_NEG)
        m_new = tl.maximum(m, z)
        alpha = tl.exp(m - m_new)
        e = tl.where(mask, tl.exp(z - m_new), 0.0)
        if WITH_ENTROPY:
            t = alpha * (t + s * (m - m_new)) + e * (z - m_new)
        s = s * alpha + e
        m = m_new
    top = tl.max(m, 0)
    scale = tl.exp(m - top)
    total = tl.sum(s * scale, 0)
    lse = top + tl.log(total)
    tl.store(LSE + row, lse)
    target = tl.load(TARGETS + row)
    tl.store(LOGP + row, tl.load(base + target) - lse)
    if WITH_ENTROPY:  # -sum p (z - lse) = log(total) - sum exp(z - top) (z - top) / total
        weighted = tl.sum(scale * (t + s * (m - top)), 0)
        tl.store(ENTROPY + row, tl.log(total) - weighted / total)


@triton.jit
def _backward_kernel(Z, TARGETS, LSE, GRAD, DX, stride_z, stride_dx, V, scale, BLOCK: tl.constexpr):
    """dx = (onehot(target) - softmax(z)) * grad * scale, in DX's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0)
    g = tl.load(GRAD + row)
    p = tl.exp(z - tl.load(LSE + row))
    dz = tl.where(cols == tl.load(TARGETS + row), g, 0.0) - p * g
    tl.store(DX + row * stride_dx + cols, (dz * scale).to(DX.dtype.element_ty), mask=mask)


def chunk_forward(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool, block: int = 2048
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """z: (c, V) float32 scaled logits with a contiguous last dimension; targets: (c,) int64. Returns (lse, logp,
    entropy or None), each (c,) float32."""
    rows, vocab = z.shape
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    logp = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if with_entropy else lse
    _forward_kernel[(rows,)](z, targets, lse, logp, entropy, z.stride(0), vocab, BLOCK=block,
                             WITH_ENTROPY=with_entropy, num_warps=8)
    return lse, logp, (entropy if with_entropy else None)


def chunk_backward(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, scale: float,
                   dtype: torch.dtype, block: int = 2048) -> torch.Tensor:
    """z: (c, V) float32 scaled logits; lse, grad: (c,) float32 (d loss / d logp). Returns (c, V) in ``dtype``:
    d loss / d x for z = x * scale."""
    rows, vocab = z.shape
    dx = torch.empty(rows, vocab, dtype=dtype, device=z.device)
    _backward_kernel[(rows, triton.cdiv(vocab, block))](z, targets, lse, grad, dx, z.stride(0), dx.stride(0), vocab,
                                                        scale, BLOCK=block, num_warps=8)
    return dx
