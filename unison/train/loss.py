"""The GRPO loss: PPO clipping plus an importance-sampling correction against the engine's logprobs.

One optimizer update per batch, so the behaviour policy is the engine itself: per token,
ratio = exp(logp_trainer - logp_engine). Without the correction, the trainer/engine mismatch (bf16
kernels, stale in-flight KV, sampling under an older weight version) biases the gradient silently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..config import check_literals

# exp() of a larger log-ratio overflows fp32 to inf, and a dropped token's 0 * inf gradient is NaN.
_MAX_LOG_RATIO = 20.0


@dataclass
class LossConfig:
    eps_low: float = 0.2
    """PPO lower clip: ratios below 1 - eps_low stop pushing a negative-advantage token further down."""
    eps_high: float = 0.28
    """PPO upper clip (asymmetric, DAPO's clip-higher): ratios above 1 + eps_high stop a positive push."""
    is_mode: Literal["mask", "truncate"] = "mask"
    """'mask': drop tokens whose ratio is outside [is_min, is_max] (MIS); 'truncate': scale each token's
    loss by min(1, is_max / ratio) (TIS)."""
    is_min: float = 0.5
    """Lowest ratio a token may have and stay in the loss (mask mode only)."""
    is_max: float = 2.0
    """Highest ratio kept (mask) or the truncation level (truncate)."""

    def __post_init__(self):
        if not 0.0 <= self.eps_low < 1.0:
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if not self.eps_high >= 0.0:
            raise ValueError(f"eps_high must be >= 0, got {self.eps_high}")
        check_literals(self)
        if not 0.0 <= self.is_min <= 1.0:
            raise ValueError(f"is_min must be in [0, 1], got {self.is_min}")
        if not self.is_max >= 1.0:
            raise ValueError(f"is_max must be >= 1, got {self.is_max}")


def grpo_loss(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, advantages: torch.Tensor,
              cfg: LossConfig, num_loss_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch and its metrics.

    logprobs: (M,) float32, the trainer's, differentiable; engine_logprobs, advantages: (M,) float32.
    ``num_loss_tokens`` is the number of loss tokens in the whole optimizer step (all micro-batches and
    ranks), so the micro-batch losses sum to the token-level mean over the step.

    Returns (loss: () float32, metrics). The metrics are this micro-batch's means over its M tokens
    (``mismatch/logprob_diff_max`` a max) plus ``tokens`` = M; ``MetricAccumulator`` reduces them over
    micro-batches, weighting by tokens:
      is/ratio_mean   mean of exp(logp - engine_logp)
      is/clipfrac     fraction of tokens whose PPO clip is active (zero gradient) = clip/low + clip/high
      clip/low        advantage < 0 and ratio < 1 - eps_low
      clip/high       advantage > 0 and ratio > 1 + eps_high
      is/dropped_frac mask: fraction dropped by the IS bounds; truncate: fraction with weight < 1
      mismatch/logprob_diff_mean, mismatch/logprob_diff_max   |logp - engine_logp|
      mismatch/kl     k3 estimate of KL(engine || trainer): mean of (ratio - 1) - log ratio, >= 0 per token
    """
    if num_loss_tokens < 1:
        raise ValueError(f"num_loss_tokens must be >= 1, got {num_loss_tokens}")
    if not logprobs.shape == engine_logprobs.shape == advantages.shape or logprobs.ndim != 1:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, engine_logprobs {tuple(engine_logprobs.shape)} "
                         f"and advantages {tuple(advantages.shape)} must be the same (M,) shape")
    log_ratio = (logprobs - engine_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        r = ratio.detach()
        if cfg.is_mode == "mask":
            is_weight = ((r >= cfg.is_min) & (r <= cfg.is_max)).float()
        else:
            is_weight = (cfg.is_max / r).clamp(max=1.0)
    loss = (per_token * is_weight).sum() / num_loss_tokens
    return loss, _metrics(logprobs.detach(), engine_logprobs, advantages, r, is_weight, cfg)


def _metrics(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, advantages: torch.Tensor,
             ratio: torch.Tensor, is_weight: torch.Tensor, cfg: LossConfig) -> dict[str, float]:
    m = logprobs.numel()
    if m == 0:
        return {"tokens": 0}
    clip_low = (advantages < 0) & (ratio < 1.0 - cfg.eps_low)
    clip_high = (advantages > 0) & (ratio > 1.0 + cfg.eps_high)
    diff = (logprobs - engine_logprobs).abs()
    log_ratio = (logprobs - engine_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    # One device-to-host transfer for all metrics rather than one sync per .item().
    values = torch.stack([
        ratio.mean(),
        (clip_low | clip_high).float().mean(),
        clip_low.float().mean(),
        clip_high.float().mean(),
        (is_weight < 1.0).float().mean(),
        diff.mean(),
        diff.max(),
        (ratio - 1.0 - log_ratio).mean(),
    ]).tolist()
    keys = ("is/ratio_mean", "is/clipfrac", "clip/low", "clip/high", "is/dropped_frac",
            "mismatch/logprob_diff_mean", "mismatch/logprob_diff_max", "mismatch/kl")
    return {"tokens": m, **dict(zip(keys, values, strict=True))}


class MetricAccumulator:
    """Reduces ``grpo_loss`` metrics over the micro-batches of a step: keys ending in ``_max`` by max,
    every other key by a token-weighted mean.

    >>> acc = MetricAccumulator()
    >>> acc.add({"tokens": 1, "is/ratio_mean": 1.0, "mismatch/logprob_diff_max": 0.1})
    >>> acc.add({"tokens": 3, "is/ratio_mean": 2.0, "mismatch/logprob_diff_max": 0.3})
    >>> acc.reduce()
    {'tokens': 4, 'is/ratio_mean': 1.75, 'mismatch/logprob_diff_max': 0.3}
    """

    def __init__(self):
        self.tokens = 0
        self._sums: dict[str, float] = {}
        self._maxes: dict[str, float] = {}

    def add(self, metrics: dict[str, float]) -> None:
        n = int(metrics["tokens"])
        if n == 0:
            return
        self.tokens += n
        for key, value in metrics.items():
            if key == "tokens":
                continue
            if key.endswith("_max"):
                self._maxes[key] = max(self._maxes.get(key, float("-inf")), value)
            else:
                self._sums[key] = self._sums.get(key, 0.0) + value * n

    def reduce(self) -> dict[str, float]:
        out: dict[str, float] = {"tokens": self.tokens}
        out.update({k: s / self.tokens for k, s in self._sums.items()})
        out.update(self._maxes)
        return out
