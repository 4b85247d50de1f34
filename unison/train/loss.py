"""The GRPO loss: PPO clipping plus an importance-sampling correction against the engine's logprobs.

With one optimizer update per batch the behaviour policy is the engine itself: per token,
ratio = exp(logp_trainer - logp_engine). Without the correction, the trainer/engine mismatch (bf16
kernels, stale in-flight KV, sampling under an older weight version) biases the gradient silently.
With several updates per batch (``step.num_iterations``) the later ones take the trainer's logprobs from before
the first update as the PPO ratio's denominator, and the engine correction is then the fixed masked or truncated
exp(logp_old - logp_engine).

``loss.type`` picks TRL's GRPOTrainer objective and normalisation (``loss_divisor``): dapo (unison's default,
TRL's too) divides every token's loss by the step's loss tokens; grpo by the sequence's length and the step's
sequences; dr_grpo by sequences x max_completion_length; bnpo by this replica's tokens (x replicas); gspo is grpo
with the sequence-level ratio exp(mean log-ratio) of the GSPO paper; cispo weighs -A * logp by the stop-gradient
IS weight min(ratio, eps_high) (MiniMax-M1, TRL's form).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..config import check_literals

# exp() of a larger log-ratio overflows fp32 to inf, and a dropped token's 0 * inf gradient is NaN.
_MAX_LOG_RATIO = 20.0


LossType = Literal["dapo", "grpo", "dr_grpo", "bnpo", "gspo", "cispo"]


@dataclass
class LossConfig:
    type: LossType = "dapo"
    """The objective and its normalisation, as TRL's GRPOTrainer ``loss_type``: 'dapo' (token-level over the step's
    tokens, every replica's; what unison always did), 'grpo' (each sequence's mean, then the mean over sequences),
    'dr_grpo' (sum over sequences x rollout.max_new_tokens), 'bnpo' (token-level over this replica's tokens;
    'dapo' on one process), 'gspo' (grpo with the sequence-level ratio exp(mean log-ratio), TRL's
    importance_sampling_level='sequence'; the engine correction acts on that ratio too; the GSPO paper clips at
    eps_low=3e-4, eps_high=4e-4), 'cispo' (-sg(min(ratio, eps_high)) * A * logp, normalised as dapo; eps_high is
    then the cap itself, TRL's meaning: 5.0 in ScaleRL)."""
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
    beta: float = 0.0
    """Weight of the k3 KL to a frozen copy of the initial policy, per token (TRL's ``beta``); 0: no reference model
    is built. It lives on the GPU, or in pinned host memory streamed layer by layer with ``optim.placement=host``."""
    mask_truncated_completions: bool = False
    """A completion cut at the token limit (finish 'length', no eos) contributes no loss (DAPO, TRL's flag); it
    still counts as a sequence in the grpo, gspo and dr_grpo normalisers, as in TRL."""

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
        if not self.beta >= 0.0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.type == "cispo" and not self.eps_high >= 1.0:
            raise ValueError(f"type='cispo' caps the IS weight at eps_high itself (TRL's meaning), got eps_high="
                             f"{self.eps_high}: set loss.eps_high >= 1 (ScaleRL recommends 5.0)")


def grpo_loss(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, advantages: torch.Tensor,
              cfg: LossConfig, num_loss_tokens: int, *, divisor: torch.Tensor | float | None = None,
              seq_lens: list[int] | None = None, old_logprobs: torch.Tensor | None = None,
              ref_logprobs: torch.Tensor | None = None, read_metrics: bool = True
              ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch and its metrics.

    logprobs: (M,) float32, the trainer's, differentiable; engine_logprobs, advantages: (M,) float32.
    ``num_loss_tokens`` is the number of loss tokens in the whole optimizer step (all micro-batches and
    ranks), so the micro-batch losses sum to the token-level mean over the step (``cfg.type`` 'dapo').
    ``divisor`` replaces it: each token's loss is divided by it, (M,) float32 or a number (``loss_divisor``).
    seq_lens: the lengths of the micro-batch's sequences, in order, summing to M (needed by 'gspo').
    old_logprobs: (M,) float32, the trainer's before the step's first update: the PPO ratio's denominator (None:
    the engine's). ref_logprobs: (M,) float32 of the reference model, for ``cfg.beta`` > 0.

    ``read_metrics=False`` leaves the metric values on the device as 0-dim tensors (``MetricAccumulator`` takes
    them and reads them once, in ``reduce``), so the step never waits on the GPU between micro-batches.

    Returns (loss: () float32, metrics). The metrics are this micro-batch's means over its M tokens
    (``mismatch/logprob_diff_max`` a max) plus ``tokens`` = M; ``MetricAccumulator`` reduces them over
    micro-batches, weighting by tokens:
      is/ratio_mean   mean of the PPO ratio (exp(logp - engine_logp) unless old_logprobs)
      is/clipfrac     fraction of tokens whose PPO clip is active (zero gradient) = clip/low + clip/high
      clip/low        advantage < 0 and ratio < 1 - eps_low
      clip/high       advantage > 0 and ratio > 1 + eps_high (cispo: ratio > eps_high, its weight capped)
      is/dropped_frac mask: fraction dropped by the IS bounds; truncate: fraction truncated
      mismatch/logprob_diff_mean, mismatch/logprob_diff_max   |logp - engine_logp|
      mismatch/kl     k3 estimate of KL(engine || trainer): mean of (ratio - 1) - log ratio, >= 0 per token
      kl/ref_mean     with a reference: mean of the k3 exp(ref - logp) - (ref - logp) - 1
    """
    if num_loss_tokens < 1:
        raise ValueError(f"num_loss_tokens must be >= 1, got {num_loss_tokens}")
    if not logprobs.shape == engine_logprobs.shape == advantages.shape or logprobs.ndim != 1:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, engine_logprobs {tuple(engine_logprobs.shape)} "
                         f"and advantages {tuple(advantages.shape)} must be the same (M,) shape")
    for name, t in (("old_logprobs", old_logprobs), ("ref_logprobs", ref_logprobs)):
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have logprobs' shape {tuple(logprobs.shape)}")
    if cfg.beta > 0 and ref_logprobs is None:
        raise ValueError(f"loss.beta={cfg.beta} needs ref_logprobs (the reference model's)")
    seq_ids = None
    if cfg.type == "gspo":
        if seq_lens is None or sum(seq_lens) != logprobs.numel():
            raise ValueError(f"type='gspo' needs seq_lens summing to {logprobs.numel()}, got {seq_lens}")
        # Made on the host and sent without a wait (on the device, repeat_interleave reads its size back).
        seq_ids = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens)).to(
            logprobs.device, non_blocking=True)
    per_token, r, dropped, ref_kl = _token_terms(logprobs, engine_logprobs, advantages, cfg, old_logprobs,
                                                 ref_logprobs, seq_ids, seq_lens)
    loss = _normalised_sum(per_token, divisor, num_loss_tokens)
    metrics = _metrics(logprobs.detach(), engine_logprobs, advantages, r, dropped, cfg, read_metrics)
    if ref_kl is not None and logprobs.numel():
        kl = ref_kl.detach().mean()
        metrics["kl/ref_mean"] = kl.item() if read_metrics else kl
    return loss, metrics


def token_loss(engine_logprobs: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig, num_loss_tokens: int, *,
               divisor: torch.Tensor | float | None = None, old_logprobs: torch.Tensor | None = None,
               ref_logprobs: torch.Tensor | None = None) -> TokenLoss | None:
    """``grpo_loss``'s loss as a function of any slice of the trainer's logprobs (``TokenLoss``): ``f(logprobs[a:b],
    a, b)`` is the slice's share of the loss (a 0-dim tensor, differentiable), and the shares of a partition sum to
    ``grpo_loss``'s loss. Each token's gradient is the one ``grpo_loss``'s backward gives it, bit for bit, so the
    lm_head can take the loss's gradient chunk by chunk in its forward (``unison.train.logprobs.policy_loss``); its
    Triton kernels take it in closed form from ``TokenLoss.terms``, to fp32 rounding.
    None for 'gspo': its ratio is a sequence's mean, no token's loss is its own."""
    if cfg.type == "gspo":
        return None
    return TokenLoss(engine_logprobs, advantages, cfg, num_loss_tokens, divisor, old_logprobs, ref_logprobs)


@dataclass
class TokenLoss:
    """One micro-batch's token-separable loss (``token_loss``). Besides its shares it gives the per-token terms that
    do not depend on the trainer's logprobs (``terms``), for a kernel that takes each token's gradient in closed form
    (``unison.train.triton_logprobs``)."""

    engine_logprobs: torch.Tensor
    advantages: torch.Tensor
    cfg: LossConfig
    num_loss_tokens: int
    divisor: torch.Tensor | float | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None

    def __call__(self, logprobs: torch.Tensor, start: int, end: int) -> torch.Tensor:
        cut = (lambda t: t[start:end] if isinstance(t, torch.Tensor) and t.ndim else t)
        per_token = _token_terms(logprobs, cut(self.engine_logprobs), cut(self.advantages), self.cfg,
                                 cut(self.old_logprobs), cut(self.ref_logprobs), None, None)[0]
        return _normalised_sum(per_token, cut(self.divisor), self.num_loss_tokens)

    def terms(self) -> TokenTerms:
        """The terms of every token (``TokenTerms``), as the loss's backward sees them."""
        base = self.engine_logprobs if self.old_logprobs is None else self.old_logprobs
        m = base.shape[0]
        if self.divisor is None:  # the backward of sum() / N hands every token 1 / N, of sum(x / d) 1 / d
            scale = (torch.ones((), device=base.device) / self.num_loss_tokens).expand(m)
        elif isinstance(self.divisor, torch.Tensor) and self.divisor.ndim:
            scale = 1.0 / self.divisor
        else:
            scale = (torch.ones((), device=base.device) / float(self.divisor)).expand(m)
        fixed = None
        if self.old_logprobs is not None:
            fixed = _fixed_is_weight(self.old_logprobs, self.engine_logprobs, self.cfg, None, None)[0]
        flat = (lambda t: t.float().contiguous() if t is not None else None)  # a kernel reads them as such
        return TokenTerms(flat(base), flat(self.advantages), scale.float(), flat(fixed),
                          flat(self.ref_logprobs) if self.cfg.beta > 0 else None, self.cfg)


@dataclass(frozen=True)
class TokenTerms:
    """Per token: the PPO ratio's denominator (the engine's logprobs or the old ones), the advantage, what the
    normalisation scales its gradient by (1 / N or 1 / its divisor), the fixed IS weight of later iterations (None:
    against the engine, from the ratio) and the reference's logprobs (None without beta); each (M,) float32."""

    base: torch.Tensor
    advantages: torch.Tensor
    scale: torch.Tensor
    fixed_weight: torch.Tensor | None
    ref: torch.Tensor | None
    cfg: LossConfig


def _token_terms(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig,
                 old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, seq_ids: torch.Tensor | None,
                 seq_lens: list[int] | None):
    """Each token's loss before normalisation (differentiable w.r.t. ``logprobs``), the detached PPO ratio, the
    tokens the IS correction dropped or truncated, and the k3 KL to the reference (None without beta)."""
    base = engine_logprobs if old_logprobs is None else old_logprobs
    log_ratio = _level((logprobs - base).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO), seq_ids, seq_lens)
    ratio = torch.exp(log_ratio)
    if cfg.type == "cispo":
        per_token = -(ratio.clamp(max=cfg.eps_high).detach() * advantages * logprobs)
    else:
        clipped = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
        per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    with torch.no_grad():
        r = ratio.detach()
        if old_logprobs is None:  # the ratio is against the engine: its weight corrects it
            if cfg.is_mode == "mask":
                is_weight = ((r >= cfg.is_min) & (r <= cfg.is_max)).float()
            else:
                is_weight = (cfg.is_max / r).clamp(max=1.0)
            dropped = is_weight < 1.0
        else:  # the fixed correction from the trainer's old policy to the engine that sampled
            is_weight, dropped = _fixed_is_weight(old_logprobs, engine_logprobs, cfg, seq_ids, seq_lens)
    per_token = per_token * is_weight
    ref_kl = None
    if cfg.beta > 0:
        ref_diff = ref_logprobs - logprobs
        ref_kl = torch.exp(ref_diff) - ref_diff - 1.0
        per_token = per_token + cfg.beta * ref_kl
    return per_token, r, dropped, ref_kl


def _fixed_is_weight(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cfg: LossConfig,
                     seq_ids: torch.Tensor | None, seq_lens: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Later iterations' IS weight from the trainer's old policy to the engine that sampled, and which tokens it
    dropped (mask) or truncated."""
    r_is = torch.exp(_level((old_logprobs - engine_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO),
                            seq_ids, seq_lens))
    kept = (r_is >= cfg.is_min) & (r_is <= cfg.is_max)
    is_weight = r_is * kept if cfg.is_mode == "mask" else r_is.clamp(max=cfg.is_max)
    return is_weight, (~kept if cfg.is_mode == "mask" else r_is > cfg.is_max)


def _normalised_sum(per_token: torch.Tensor, divisor: torch.Tensor | float | None, num_loss_tokens: int
                    ) -> torch.Tensor:
    return per_token.sum() / num_loss_tokens if divisor is None else (per_token / divisor).sum()


def _level(log_ratio: torch.Tensor, seq_ids: torch.Tensor | None, seq_lens: list[int] | None) -> torch.Tensor:
    """Token-level log-ratios as they are, or (seq_ids given) each sequence's mean at every one of its tokens."""
    if seq_ids is None:
        return log_ratio
    lens = torch.tensor(seq_lens, dtype=log_ratio.dtype).to(log_ratio.device, non_blocking=True)
    sums = torch.zeros(len(seq_lens), dtype=log_ratio.dtype, device=log_ratio.device).index_add(0, seq_ids, log_ratio)
    return (sums / lens)[seq_ids]


def loss_divisor(loss_type: str, seq_lens: list[int], step_tokens: int, step_sequences: int, local_tokens: int,
                 replicas: int, max_completion_length: int) -> torch.Tensor | float | None:
    """What each loss token of one micro-batch (sequences of ``seq_lens``) is divided by, TRL's normalisations over
    the whole optimizer step: None for dapo and cispo (``num_loss_tokens``, the step's tokens); grpo and gspo:
    (M,) float32 of each token's sequence length x the step's sequences; dr_grpo: the step's sequences x
    ``max_completion_length``; bnpo: this replica's tokens x replicas (the gradients are summed across replicas)."""
    if loss_type in ("dapo", "cispo"):
        return None
    if loss_type in ("grpo", "gspo"):
        lens = torch.tensor(seq_lens, dtype=torch.float32)
        return torch.repeat_interleave(lens, lens.long()) * float(step_sequences)
    if loss_type == "dr_grpo":
        if max_completion_length < 1:
            raise ValueError("type='dr_grpo' divides by max_completion_length (rollout.max_new_tokens): got "
                             f"{max_completion_length}")
        return float(step_sequences * max_completion_length)
    if loss_type == "bnpo":
        return float(max(local_tokens, 1) * replicas)
    raise ValueError(f"unknown loss type {loss_type!r}")


def _metrics(logprobs: torch.Tensor, engine_logprobs: torch.Tensor, advantages: torch.Tensor,
             ratio: torch.Tensor, dropped: torch.Tensor, cfg: LossConfig, read: bool = True) -> dict[str, float]:
    m = logprobs.numel()
    if m == 0:
        return {"tokens": 0}
    if cfg.type == "cispo":
        clip_low, clip_high = torch.zeros_like(ratio, dtype=torch.bool), ratio > cfg.eps_high
    else:
        clip_low = (advantages < 0) & (ratio < 1.0 - cfg.eps_low)
        clip_high = (advantages > 0) & (ratio > 1.0 + cfg.eps_high)
    diff = (logprobs - engine_logprobs).abs()
    log_ratio = (logprobs - engine_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    engine_ratio = torch.exp(log_ratio)
    # One device-to-host transfer for all metrics rather than one sync per .item().
    values = torch.stack([
        ratio.mean(),
        (clip_low | clip_high).float().mean(),
        clip_low.float().mean(),
        clip_high.float().mean(),
        dropped.float().mean(),
        diff.mean(),
        diff.max(),
        (engine_ratio - 1.0 - log_ratio).mean(),
    ])
    values = values.tolist() if read else values.unbind()
    keys = ("is/ratio_mean", "is/clipfrac", "clip/low", "clip/high", "is/dropped_frac",
            "mismatch/logprob_diff_mean", "mismatch/logprob_diff_max", "mismatch/kl")
    return {"tokens": m, **dict(zip(keys, values, strict=True))}


class MetricAccumulator:
    """Reduces ``grpo_loss`` metrics over the micro-batches of a step: keys ending in ``_max`` by max,
    every other key by a token-weighted mean. Values may be numbers or 0-dim device tensors (read once, in
    ``reduce``).

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
                held = self._maxes.get(key)
                self._maxes[key] = value if held is None else _larger(held, value)
            else:
                self._sums[key] = self._sums.get(key, 0.0) + value * n

    def reduce(self) -> dict[str, float]:
        out: dict = {"tokens": self.tokens}
        out.update({k: s / self.tokens for k, s in self._sums.items()})
        out.update(self._maxes)
        on_device = [k for k, v in out.items() if isinstance(v, torch.Tensor)]
        if on_device:  # one read for all of them
            device = out[on_device[0]].device
            read = torch.stack([out[k].float().to(device) for k in on_device]).tolist()
            out.update(zip(on_device, read, strict=True))
        return out


def _larger(a, b):
    """max of two numbers or 0-dim tensors, on the device where either is a tensor (no read)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)
