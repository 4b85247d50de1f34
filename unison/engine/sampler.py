"""Sampling with the logprob of the sampled token under the distribution it was drawn from.

Per row, in the order HF's ``generate`` applies them: the repetition penalty on the raw logits
(``apply_repetition_penalty``, before either sampler), then logits / temperature, top-k, top-p over the
renormalised top-k distribution, and min-p (drop tokens less likely than ``min_p`` times the most likely one); the
logprob is log_softmax over the kept set. Temperature 0 is greedy, its logprob taken at temperature 1 (with the
same cuts). Draws use the exponential race (argmax of p / Exp(1) noise), which is exact sampling and lets each
seeded request draw its noise from its own generator, independent of what else is in the batch.
"""

from __future__ import annotations

import math

import torch


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           generators: list[torch.Generator | None], default_generator: torch.Generator | None,
           min_p: list[float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (S, V) any float dtype. Returns tokens (S,) int64 and their logprobs (S,) float32."""
    logits = logits.float()
    device = logits.device
    temps = torch.tensor(temperature, dtype=torch.float32, device=device)
    greedy = temps == 0
    logits = logits / torch.where(greedy, 1.0, temps)[:, None]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        logits = apply_top_k_top_p(logits, top_k, top_p)
    if min_p is not None and any(p > 0 for p in min_p):
        logits = apply_min_p(logits, min_p)
    logp = torch.log_softmax(logits, dim=-1)
    noise = torch.empty_like(logp)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        noise[shared] = torch.empty(len(shared), logp.shape[1], device=device).exponential_(
            generator=default_generator)
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    tokens = torch.where(greedy, logp.argmax(-1), (logp - noise.log()).argmax(-1))
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """logits: (S, V) float32, already divided by temperature. Entries cut by top-k or top-p become -inf."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    p = torch.tensor(top_p, dtype=torch.float32, device=logits.device)[:, None]
    # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
    drop = ((probs.cumsum(dim=-1) - probs) >= p) & (p < 1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """logits: (S, V) float32 after temperature (and top-k/top-p). Entries with p < min_p * max p become -inf:
    in logits, x < max x + log(min_p), which renormalising over the kept set leaves unchanged. 0 keeps all."""
    floor = torch.tensor([math.log(p) if p > 0 else -math.inf for p in min_p], device=logits.device)
    cut = logits < logits.max(dim=-1, keepdim=True).values + floor[:, None]
    return logits.masked_fill(cut, float("-inf"))


def apply_repetition_penalty(logits: torch.Tensor, rows: list[int], seen: list[list[int]],
                             penalties: list[float]) -> torch.Tensor:
    """HF's and vLLM's repetition penalty: logits (S, V) float32 (raw: before temperature) with, in row ``rows[i]``,
    the logit x of every token in ``seen[i]`` (the request's prompt and output so far) made x / p where x > 0 and
    x * p otherwise, p = ``penalties[i]`` (> 1 discourages repeats). A new tensor (the engine's logits are inference
    tensors)."""
    if not rows:
        return logits
    device = logits.device
    row_idx = torch.tensor([r for r, ids in zip(rows, seen, strict=True) for _ in ids], device=device)
    col_idx = torch.tensor([t for ids in seen for t in ids], device=device)
    p = torch.tensor([q for q, ids in zip(penalties, seen, strict=True) for _ in ids], dtype=logits.dtype,
                     device=device)
    x = logits[row_idx, col_idx]  # a token seen twice is gathered twice and written twice, with the same value
    return logits.index_put((row_idx, col_idx), torch.where(x > 0, x / p, x * p))
