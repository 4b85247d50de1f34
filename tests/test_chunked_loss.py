"""The lm_head's gradient taken in its forward (``chunked_loss``, ``policy_loss``, ``token_loss``): the same bits as
the logprobs, then the loss, then a backward that recomputes the logits, for every token-separable loss type."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from test_losses import _samples

from unison.engine.lm_head import IDENTITY, HeadTransform
from unison.train import step as step_module
from unison.train.logprobs import chunked_logprobs, chunked_loss
from unison.train.loss import LossConfig, grpo_loss, token_loss
from unison.train.optimizer import MasterAdamW, OptimConfig
from unison.train.step import train_step

M, H, V, CHUNK = 37, 16, 50, 8  # 8 does not divide 37


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(M, H, generator=g).to(dtype).requires_grad_(True)
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_(True)
    targets = torch.randint(0, V, (M,), generator=g)
    with torch.no_grad():
        logp, _ = chunked_logprobs(hidden, weight, targets, 0.7, CHUNK)
    # The engine's and the reference's logprobs near the trainer's, so that ratios land inside and outside the
    # clip and IS bounds; advantages of both signs.
    extra = dict(engine=logp + 0.4 * torch.randn(M, generator=g), advantages=torch.randn(M, generator=g),
                 old=logp + 0.3 * torch.randn(M, generator=g), ref=logp + 0.2 * torch.randn(M, generator=g))
    return hidden, weight, targets, extra


def _divisor(loss_type):
    if loss_type == "grpo":
        return torch.rand(M, generator=torch.Generator().manual_seed(9)) * 10 + 1
    return {"dr_grpo": 7.0, "bnpo": 11.0}.get(loss_type)


def _two_pass(hidden, weight, targets, cfg, transform, loss_args, extra):
    logp, entropy = chunked_logprobs(hidden, weight, targets, 0.7, CHUNK, with_entropy=True, transform=transform)
    loss, _ = grpo_loss(logp, extra["engine"], extra["advantages"], cfg, 100, **loss_args)
    loss.backward()
    return loss.detach(), logp.detach(), entropy


CASES = [(t, mode) for t in ("dapo", "grpo", "dr_grpo", "bnpo", "cispo") for mode in ("mask", "truncate")]


@pytest.mark.parametrize("transform", [IDENTITY, HeadTransform(scale=0.5, softcap=3.0)], ids=["plain", "softcap"])
@pytest.mark.parametrize("later", [False, True], ids=["first", "old+ref"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("loss_type,is_mode", CASES)
def test_gradient_in_the_forward_is_the_backwards_bit_for_bit(loss_type, is_mode, dtype, later, transform):
    cfg = LossConfig(type=loss_type, is_mode=is_mode, is_max=1.5, eps_high=5.0 if loss_type == "cispo" else 0.28,
                     beta=0.05 if later else 0.0)
    hidden, weight, targets, extra = _inputs(dtype)
    loss_args = dict(divisor=_divisor(loss_type), old_logprobs=extra["old"] if later else None,
                     ref_logprobs=extra["ref"] if later else None)
    want_loss, want_logp, want_entropy = _two_pass(hidden, weight, targets, cfg, transform, loss_args, extra)
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    share = token_loss(extra["engine"], extra["advantages"], cfg, 100, **loss_args)
    loss, logp, entropy = chunked_loss(hidden, weight, targets, share, 0.7, CHUNK, with_entropy=True,
                                       transform=transform)
    assert loss.requires_grad and not logp.requires_grad and not entropy.requires_grad
    loss.backward()
    assert torch.equal(logp, want_logp) and torch.equal(entropy, want_entropy)
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-5, atol=1e-6)  # the shares summed chunk by chunk
    assert torch.equal(hidden.grad, want[0]) and torch.equal(weight.grad, want[1])
    assert want[1].abs().max() > 1e-4  # a real gradient, not two zeros agreeing


def test_shares_of_a_partition_sum_to_the_loss_and_gspo_has_none():
    _, _, _, extra = _inputs(torch.float32)
    logp = extra["engine"] - 0.2
    cfg = LossConfig(type="grpo", beta=0.1)
    args = dict(divisor=_divisor("grpo"), ref_logprobs=extra["ref"])
    share = token_loss(extra["engine"], extra["advantages"], cfg, 100, **args)
    whole, _ = grpo_loss(logp, extra["engine"], extra["advantages"], cfg, 100, **args)
    parts = share(logp[:10], 0, 10) + share(logp[10:25], 10, 25) + share(logp[25:], 25, M)
    torch.testing.assert_close(parts, whole, rtol=1e-6, atol=1e-7)
    assert token_loss(extra["engine"], extra["advantages"], LossConfig(type="gspo"), 100) is None


def test_frozen_head_upstream_scale_and_a_second_backward():
    hidden, weight, targets, extra = _inputs(torch.float32)
    share = token_loss(extra["engine"], extra["advantages"], LossConfig(), 100)
    loss, _, _ = chunked_loss(hidden, weight, targets, share, 0.7, CHUNK)
    (3.0 * loss).backward(retain_graph=True)
    scaled = hidden.grad.clone()
    hidden.grad = weight.grad = None
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()

    frozen = weight.detach()  # a LoRA policy's head: only the hidden states get a gradient
    loss, _, _ = chunked_loss(hidden, frozen, targets, share, 0.7, CHUNK)
    loss.backward()
    torch.testing.assert_close(scaled, 3.0 * hidden.grad, rtol=1e-6, atol=0)
    assert hidden.grad.abs().max() > 0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo"])
def test_train_step_takes_the_same_step_either_way(loss_type, monkeypatch):
    """A whole train_step (tied weights: the head's gradient meets the embedding's) with the gradient in the forward
    and with the recompute (``token_loss`` answering None, as for gspo): the same parameters, bit for bit."""
    cfg = LossConfig(type=loss_type, eps_high=5.0 if loss_type == "cispo" else 0.28)
    runs, calls = [], []
    for name in ("policy_loss", "policy_logprobs"):  # which path each run took
        original = getattr(step_module, name)
        monkeypatch.setattr(step_module, name, lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k))
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(step_module, "token_loss", lambda *a, **k: None)
        model = tiny_llama()
        model.lm_head.weight = model.model.embed_tokens.weight
        opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=1e-2), total_steps=10)
        metrics = train_step(model, opt, _samples(), cfg, 1.0, 64, 0, 4)
        runs.append((metrics, {n: p.detach().clone() for n, p in model.named_parameters()}))
        assert set(calls) == {"policy_loss" if fused else "policy_logprobs"} and len(calls) == metrics["train/rows"]
        calls.clear()
    (fused_metrics, fused_params), (plain_metrics, plain_params) = runs
    assert fused_metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-6)
    assert fused_metrics["is/ratio_mean"] == plain_metrics["is/ratio_mean"]
    assert fused_metrics["optim/grad_norm"] == plain_metrics["optim/grad_norm"] > 0
    for name, p in plain_params.items():
        assert torch.equal(fused_params[name], p), name
