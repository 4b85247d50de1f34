"""The chunked lm_head's per-token reductions in one pass over each fp32 logits chunk (``unison.train.logprobs``).

A chunk's logits are [1024, vocab] fp32: 622 MB at Qwen3's 152k vocabulary, 36 chunks for a 64 x 512-token step.
PyTorch's log-sum-exp, target gather and entropy read and write that block about six times in the forward, and
the backward's softmax, scatter, scale and downcast as many again. Here the forward reads it once (an online
log-sum-exp that carries the entropy's sum along, every term relative to the running maximum, so nothing cancels
at large logits) and the backward reads it once and writes the bf16 gradient of the raw logits. Given the GRPO
loss's per-token terms (``chunk_loss_backward``), the backward also takes each token's d loss / d logp itself, in
closed form, where a loss share and autograd's gradient of it cost ~48 small launches a chunk.
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
def _token_grad(row, LOGP, BASE, ADV, SCALE, stride_scale, FIXED, REF, low, high, is_min, is_max, beta,
                CISPO: tl.constexpr, IS_MODE: tl.constexpr, BETA: tl.constexpr):
    """d loss / d logp of token ``row`` for ``unison.train.loss.TokenLoss`` (``TokenTerms``), in closed form: each
    factor autograd's backward of ``_token_terms`` applies, in its order. The PPO clip is [low, high] (cispo: high
    caps the weight); IS_MODE 0: the fixed weight FIXED; 1: mask by the ratio; 2: truncate."""
    logp = tl.load(LOGP + row)
    raw = logp - tl.load(BASE + row)
    r = tl.exp(tl.minimum(tl.maximum(raw, -20.0), 20.0))
    s = tl.load(SCALE + row * stride_scale)
    if IS_MODE == 0:
        w = tl.load(FIXED + row)
    elif IS_MODE == 1:
        w = tl.where((r >= is_min) & (r <= is_max), 1.0, 0.0)
    else:
        w = tl.minimum((1.0 / r) * is_max, 1.0)
    g = -(s * w)
    a = tl.load(ADV + row)
    if CISPO:  # -(min(r, eps_high) * A * logp), the weight detached
        d = g * (tl.minimum(r, high) * a)
    else:  # -min(r * A, clip(r) * A): a tie splits the gradient in halves, as torch.minimum's backward does
        pa, pb = r * a, tl.minimum(tl.maximum(r, low), high) * a
        ga = tl.where(pa < pb, g, tl.where(pa == pb, g * 0.5, 0.0))
        gb = tl.where(pa > pb, g, tl.where(pa == pb, g * 0.5, 0.0))
        d = (ga * a + tl.where((r >= low) & (r <= high), gb * a, 0.0)) * r
        d = tl.where((raw >= -20.0) & (raw <= 20.0), d, 0.0)
    if BETA:  # + beta * (exp(ref - logp) - (ref - logp) - 1)
        t = s * beta
        d = d - (t * tl.exp(tl.load(REF + row) - logp) - t)
    return d


@triton.jit
def _backward_kernel(Z, TARGETS, LSE, GRAD, DX, stride_z, stride_dx, V, scale, LOGP, BASE, ADV, SCALE, stride_scale,
                     FIXED, REF, low, high, is_min, is_max, beta, BLOCK: tl.constexpr, LOSS: tl.constexpr,
                     CISPO: tl.constexpr, IS_MODE: tl.constexpr, BETA: tl.constexpr):
    """dx = (onehot(target) - softmax(z)) * grad * scale, in DX's dtype; with LOSS, grad is the token's loss gradient
    (``_token_grad``) rather than GRAD's."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0)
    if LOSS:
        g = _token_grad(row, LOGP, BASE, ADV, SCALE, stride_scale, FIXED, REF, low, high, is_min, is_max, beta,
                        CISPO, IS_MODE, BETA)
    else:
        g = tl.load(GRAD + row)
    p = tl.exp(z - tl.load(LSE + row))
    dz = tl.where(cols == tl.load(TARGETS + row), g, 0.0) - p * g
    tl.store(DX + row * stride_dx + cols, (dz * scale).to(DX.dtype.element_ty), mask=mask)


def chunk_forward(z: torch.Tensor, targets: torch.Tensor, with_entropy: bool, block: int = 2048,
                  logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """z: (c, V) float32 scaled logits with a contiguous last dimension; targets: (c,) int64. Returns (lse, logp,
    entropy or None), each (c,) float32; ``logp`` and ``entropy``, contiguous (c,) float32, are written if given."""
    rows, vocab = z.shape
    lse = torch.empty(rows, dtype=torch.float32, device=z.device)
    logp = torch.empty_like(lse) if logp is None else logp
    entropy = (torch.empty_like(lse) if entropy is None else entropy) if with_entropy else lse
    _forward_kernel[(rows,)](z, targets, lse, logp, entropy, z.stride(0), vocab, BLOCK=block,
                             WITH_ENTROPY=with_entropy, num_warps=8)
    return lse, logp, (entropy if with_entropy else None)


def chunk_backward(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, scale: float,
                   dtype: torch.dtype, block: int = 2048) -> torch.Tensor:
    """z: (c, V) float32 scaled logits; lse, grad: (c,) float32 (d loss / d logp). Returns (c, V) in ``dtype``:
    d loss / d x for z = x * scale."""
    return _chunk_backward(z, targets, lse, scale, dtype, block, GRAD=grad, LOSS=False, CISPO=False, IS_MODE=0,
                           BETA=False)


def chunk_loss_backward(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, logp: torch.Tensor, terms,
                        start: int, scale: float, dtype: torch.dtype, block: int = 2048) -> torch.Tensor:
    """``chunk_backward`` with each token's d loss / d logp taken in the kernel from its logprob ``logp`` ((c,)
    float32) and the loss's ``terms`` (``unison.train.loss.TokenTerms`` of the whole row; this chunk's rows start at
    ``start``)."""
    rows = z.shape[0]
    cfg = terms.cfg
    at = (lambda t: t[start:start + rows] if t is not None else logp)
    scales = terms.scale[start:start + rows]
    return _chunk_backward(
        z, targets, lse, scale, dtype, block, LOGP=logp, BASE=at(terms.base), ADV=at(terms.advantages),
        SCALE=scales, stride_scale=scales.stride(0), FIXED=at(terms.fixed_weight), REF=at(terms.ref),
        low=1.0 - cfg.eps_low, high=cfg.eps_high if cfg.type == "cispo" else 1.0 + cfg.eps_high, is_min=cfg.is_min,
        is_max=cfg.is_max, beta=cfg.beta, LOSS=True,
        CISPO=cfg.type == "cispo", IS_MODE=0 if terms.fixed_weight is not None else 1 if cfg.is_mode == "mask" else 2,
        BETA=terms.ref is not None)


def _chunk_backward(z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: float, dtype: torch.dtype,
                    block: int, **loss) -> torch.Tensor:
    rows, vocab = z.shape
    dx = torch.empty(rows, vocab, dtype=dtype, device=z.device)
    ptr = loss.get("GRAD", lse)
    args = {"GRAD": ptr, "LOGP": ptr, "BASE": ptr, "ADV": ptr, "SCALE": ptr, "stride_scale": 0, "FIXED": ptr,
            "REF": ptr, "low": 0.0, "high": 0.0, "is_min": 0.0, "is_max": 1.0, "beta": 0.0, **loss}
    _backward_kernel[(rows, triton.cdiv(vocab, block))](z, targets, lse, DX=dx, stride_z=z.stride(0),
                                                        stride_dx=dx.stride(0), V=vocab, scale=scale, BLOCK=block,
                                                        num_warps=8, **args)
    return dx
