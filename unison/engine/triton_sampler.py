"""Sampling and the sampled token's logprob in one pass over the logits (Triton), for rows without top-k/top-p.

Per row: x = logits / T; token = argmax(x + Gumbel noise) (exact sampling from softmax(x)); logprob =
x[token] - logsumexp(x). The noise comes from Philox keyed by a per-row seed and the token index (token v takes
output v % 4 of the Philox call at counter v // 4: one call per four logits, where one per logit made the kernel
compute-bound), so a seeded request draws the same noise whatever else is in the batch. Greedy rows (T = 0) add
no noise and take their logprob at T = 1. The unfused PyTorch version reads and writes the (S, V) fp32 logits
about ten times; this reads them once: each row's vocabulary is split into parts reduced side by side, then one
small kernel combines a row's parts.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _ln(x, FAST: tl.constexpr):
    """Natural log; FAST: the multiprocessor's one-instruction log2 (relative error ~2**-22), where tl.log calls
    libdevice's exact logf, a few dozen instructions (Triton's interpreter has only the exact one)."""
    if FAST:
        return libdevice.fast_log2f(x) * _LN2
    else:
        return tl.log(x)


# The part count changes with the batch size: never specialised on. TILES stays a constant (a handful of values, each
# compiled on first use): as a run-time loop bound it made the kernel ~20% slower at 256 rows (64 tiles a part).
@triton.jit(do_not_specialize=["parts"])
def _sample_part_kernel(Logits, stride_row, Params, Parts, Best, parts, VOCAB: tl.constexpr, BLOCK_V: tl.constexpr,
                        TILES: tl.constexpr, FAST_LOG: tl.constexpr):
    """One (row, part of TILES x BLOCK_V logits): the part's max, sum of exp(x - max), best perturbed value and its
    index. A tile is BLOCK_V // 4 groups of 4 consecutive logits: one Philox call draws the 4 uniforms of a group.
    Per logit: one exp for the running sum, two logs for the Gumbel noise, a quarter of a Philox call."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    inv_t = tl.load(Params + 3 * row).to(tl.float32)  # per row: 1/T, noise (1 sample, 0 greedy), seed
    noise = tl.load(Params + 3 * row + 1).to(tl.float32)
    seed = tl.load(Params + 3 * row + 2).to(tl.int64)
    base = Logits + row.to(tl.int64) * stride_row
    GROUPS: tl.constexpr = BLOCK_V // 4
    m = tl.full([GROUPS, 4], float("-inf"), tl.float32)  # per-lane running max and sum (log-sum-exp)
    s = tl.zeros([GROUPS, 4], tl.float32)
    best = tl.full([GROUPS, 4], float("-inf"), tl.float32)  # per-lane best perturbed value and its index
    best_idx = tl.full([GROUPS, 4], VOCAB, tl.int32)
    for i in range(0, TILES):
        group = (part * TILES + i) * GROUPS + tl.arange(0, GROUPS)  # the Philox counter of logits 4g .. 4g + 3
        offs = group[:, None] * 4 + tl.arange(0, 4)[None, :]
        mask = offs < VOCAB
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        # The running (max, sum) with one exp: e = exp(-|x - m|) rescales the sum where x is the new max, else is
        # x's term. Both -inf (a lane that has seen only masked logits): d is NaN, e is 0 and s stays 0.
        d = x - m
        e = tl.where(d == d, tl.exp(-tl.abs(d)), 0.0)
        s = tl.where(x > m, s * e + 1.0, s + e)
        m = tl.maximum(m, x)
        u0, u1, u2, u3 = tl.rand4x(seed, group)  # logit 4g + j takes output j of Philox(seed, g)
        u = tl.reshape(tl.join(tl.join(u0, u1), tl.join(u2, u3)), [GROUPS, 4])
        gumbel = -_ln(-_ln(u + 1e-20, FAST_LOG) + 1e-20, FAST_LOG)
        z = tl.where(mask, x + noise * gumbel, float("-inf"))
        take = z > best
        best = tl.where(take, z, best)
        best_idx = tl.where(take, offs, best_idx)
    m = tl.reshape(m, [BLOCK_V])
    s = tl.reshape(s, [BLOCK_V])
    best = tl.reshape(best, [BLOCK_V])
    best_idx = tl.reshape(best_idx, [BLOCK_V])
    m_part = tl.max(m, 0)
    shift = tl.where(m_part == float("-inf"), 0.0, m_part)
    top = tl.max(best, 0)
    out = Parts + (row * parts + part) * 3
    tl.store(out, m_part)
    tl.store(out + 1, tl.sum(s * tl.exp(m - shift), 0))
    tl.store(out + 2, top)
    tl.store(Best + row * parts + part, tl.min(tl.where(best == top, best_idx, VOCAB), 0))


@triton.jit(do_not_specialize=["parts"])
def _sample_combine_kernel(Logits, stride_row, Params, Parts, Best, Tokens, Logprobs, parts,
                           BLOCK_P: tl.constexpr):
    """One row: the parts' log-sum-exp, and the best token (the lowest index among ties, like argmax)."""
    row = tl.program_id(0)
    p = tl.arange(0, BLOCK_P)
    mask = p < parts
    stats = Parts + (row * parts + p) * 3
    m = tl.load(stats, mask=mask, other=float("-inf"))
    s = tl.load(stats + 1, mask=mask, other=0.0)
    top = tl.load(stats + 2, mask=mask, other=float("-inf"))
    idx = tl.load(Best + row * parts + p, mask=mask, other=2**30)
    m_row = tl.max(m, 0)
    lse = m_row + tl.log(tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - m_row)), 0))
    best = tl.max(top, 0)
    token = tl.min(tl.where(top == best, idx, 2**30), 0)
    inv_t = tl.load(Params + 3 * row).to(tl.float32)
    x_tok = tl.load(Logits + row.to(tl.int64) * stride_row + token).to(tl.float32) * inv_t
    tl.store(Tokens + row, token.to(tl.int64))
    tl.store(Logprobs + row, x_tok - lse)


class FusedSampler:
    """``sampler(logits, temperature, seeds)``: tokens (S,) int64 and logprobs (S,) fp32 for logits (S, V) with
    the last dim contiguous, temperatures (0 = greedy) and per-row seeds in [0, 2**52). The per-row parameters
    go through a pinned buffer in one asynchronous copy; two buffers take turns, and the caller waits for the results
    of a call before making the call after next (the engine waits for every step's tokens, at most one step late), so
    a buffer is never overwritten while its copy is pending."""

    def __init__(self, device: torch.device, max_rows: int = 1024, block_v: int = 2048, target_programs: int = 512,
                 fast_log: bool | None = None):
        self.device = torch.device(device)
        self.fast_log = (self.device.type == "cuda" and not _INTERPRET) if fast_log is None else fast_log
        self.block_v = block_v
        self.target_programs = target_programs
        self._grow(max_rows)

    def _grow(self, rows: int) -> None:
        self.max_rows = rows
        pinned = self.device.type == "cuda"
        self.hosts = [torch.empty(rows, 3, dtype=torch.float64, pin_memory=pinned) for _ in range(2 if pinned else 1)]
        self.params = None if not pinned else torch.empty(rows, 3, dtype=torch.float64, device=self.device)
        self._turn = 0

    def __call__(self, logits: torch.Tensor, temperature: list[float], seeds: list[int]
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, vocab = logits.shape
        if rows > self.max_rows:
            self._grow(2 * rows)
        t = np.asarray(temperature, dtype=np.float64)
        buffer = self.hosts[self._turn][:rows]
        self._turn = (self._turn + 1) % len(self.hosts)
        host = buffer.numpy()
        host[:, 0] = 1.0 / np.where(t > 0, t, 1.0)
        host[:, 1] = t > 0
        host[:, 2] = seeds
        params = buffer
        if self.params is not None:
            params = self.params[:rows]
            params.copy_(buffer, non_blocking=True)
        # Enough (row, part) programs to fill the device: one program per row over a 152k vocabulary leaves
        # most SMs idle at small batches (64 rows took 176 us on an H200, mostly Philox and logs, not bytes).
        # Tiles per part is a power of two, so batch sizes share a handful of compiled variants.
        tiles = -(-vocab // self.block_v)
        wanted_parts = min(tiles, -(-self.target_programs // rows))
        per_part = triton.next_power_of_2(-(-tiles // wanted_parts))
        parts = -(-tiles // per_part)
        stats = torch.empty(rows, parts, 3, dtype=torch.float32, device=logits.device)
        best = torch.empty(rows, parts, dtype=torch.int32, device=logits.device)
        tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
        logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
        _sample_part_kernel[(rows, parts)](logits, logits.stride(0), params, stats, best, parts, VOCAB=vocab,
                                           BLOCK_V=self.block_v, TILES=per_part, FAST_LOG=self.fast_log,
                                           num_warps=8)
        _sample_combine_kernel[(rows,)](logits, logits.stride(0), params, stats, best, tokens, logprobs, parts,
                                        BLOCK_P=triton.next_power_of_2(tiles), num_warps=1)
        return tokens, logprobs


def fused_sample(logits: torch.Tensor, temperature: list[float], seeds: list[int],
                 block_v: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """One-off ``FusedSampler`` call (tests, scripts)."""
    return FusedSampler(logits.device, len(temperature), block_v)(logits, temperature, seeds)
