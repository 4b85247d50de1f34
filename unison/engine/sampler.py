"""Sampling with the logprob of the sampled token under the distribution it was drawn from.

Per row: logits / temperature, then top-k, then top-p over the renormalised top-k distribution; the logprob is
log_softmax over the kept set. Temperature 0 is greedy, its logprob taken at temperature 1 (with the same
top-k/top-p cut). Draws use the exponential race (argmax of p / Exp(1) noise), which is exact sampling and lets
each seeded request draw its noise from its own generator, independent of what else is in the batch.
"""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float],
           generators: list[torch.Generator | None], default_generator: torch.Generator | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: (S, V) any float dtype. Returns tokens (S,) int64 and their logprobs (S,) float32."""
    logits = logits.float()
    device = logits.device
    temps = torch.tensor(temperature, dtype=torch.float32, device=device)
    greedy = temps == 0
    logits = logits / torch.where(greedy, 1.0, temps)[:, None]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        logits = apply_top_k_top_p(logits, top_k, top_p)
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
