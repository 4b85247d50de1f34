"""GRPO loss invariants: zero advantage, ratio 1, masked and truncated IS, PPO clip, normalisation."""

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import unison.engine.attention  # noqa: F401  (registers attn_implementation="unison")
from unison.rollout.sample import Sample
from unison.train.logprobs import policy_logprobs
from unison.train.loss import LossConfig, MetricAccumulator, grpo_loss
from unison.train.optimizer import MasterAdamW, OptimConfig
from unison.train.packing import pack_samples


def tiny_model_and_row(advantage: float):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32)
    samples = [Sample(prompt_ids=(1, 2, 3), completion_ids=(4, 5, 6, 7), engine_logprobs=(-5.0, -4.0, -6.0, -3.0),
                      weight_versions=(0,) * 4, reward=0.0, advantage=advantage),
               Sample(prompt_ids=(9, 8), completion_ids=(7, 6, 5), engine_logprobs=(-4.5, -5.5, -4.8),
                      weight_versions=(0,) * 3, reward=0.0, advantage=advantage)]
    (row,) = pack_samples(samples, max_tokens_per_row=32, pad_id=0)
    return model, row


def test_config_validation_names_the_field():
    for kwargs, field in [({"eps_low": 1.0}, "eps_low"), ({"eps_high": -0.1}, "eps_high"),
                          ({"is_mode": "clip"}, "is_mode"), ({"is_min": 1.5}, "is_min"),
                          ({"is_max": 0.9}, "is_max")]:
        with pytest.raises(ValueError, match=field):
            LossConfig(**kwargs)


@pytest.mark.parametrize("mode", ["mask", "truncate"])
def test_zero_advantage_gives_exactly_zero_gradient(mode):
    model, row = tiny_model_and_row(advantage=0.0)
    logp, _ = policy_logprobs(model, row)
    m = row.loss_mask
    loss, _ = grpo_loss(logp, row.engine_logprobs[m], row.advantages[m], LossConfig(is_mode=mode),
                        num_loss_tokens=int(m.sum()))
    loss.backward()
    assert loss.item() == 0.0
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_ratio_one_and_lr_zero_changes_nothing():
    model, row = tiny_model_and_row(advantage=1.5)
    logp, _ = policy_logprobs(model, row)
    n = int(row.loss_mask.sum())
    advantages = torch.linspace(-1.0, 2.0, n)
    loss, metrics = grpo_loss(logp, logp.detach(), advantages, LossConfig(), num_loss_tokens=n)
    assert metrics["is/ratio_mean"] == 1.0 and metrics["mismatch/kl"] == 0.0
    assert metrics["is/clipfrac"] == 0.0 and metrics["is/dropped_frac"] == 0.0
    assert metrics["mismatch/logprob_diff_max"] == 0.0
    torch.testing.assert_close(loss, -advantages.sum() / n)
    loss.backward()
    assert any(torch.count_nonzero(p.grad) > 0 for p in model.parameters())

    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=0.0, weight_decay=0.1), total_steps=1)
    stats = opt.step()
    assert stats.changed_fraction == 0.0 and stats.grad_norm > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# Ratios chosen away from the IS bounds [0.5, 2.0] and the clip range [0.8, 1.28].
RATIOS = torch.tensor([0.3, 0.55, 0.9, 1.0, 1.1, 1.9, 2.5, 10.0, 1e12])
ADV = torch.tensor([1.0, -1.0, 2.0, -0.5, 1.0, -2.0, -1.0, 1.0, -1.0])


def make_logprobs():
    logp = torch.linspace(-3.0, -1.0, len(RATIOS), requires_grad=True)
    engine = logp.detach() - torch.log(RATIOS)
    return logp, engine


def test_masked_is_drops_exactly_the_out_of_bound_tokens():
    logp, engine = make_logprobs()
    loss, metrics = grpo_loss(logp, engine, ADV, LossConfig(is_mode="mask"), num_loss_tokens=20)
    loss.backward()
    dropped = (RATIOS < 0.5) | (RATIOS > 2.0)
    assert dropped.tolist() == [True, False, False, False, False, False, True, True, True]
    assert torch.count_nonzero(logp.grad[dropped]) == 0
    # Kept tokens with an inactive clip get d/dlogp of -ratio * A / N = -ratio * A / N.
    kept_unclipped = ~dropped & ~((ADV > 0) & (RATIOS > 1.28)) & ~((ADV < 0) & (RATIOS < 0.8))
    torch.testing.assert_close(logp.grad[kept_unclipped], (-RATIOS * ADV / 20)[kept_unclipped])
    r = RATIOS[~dropped]
    manual = -torch.minimum(r * ADV[~dropped], r.clamp(0.8, 1.28) * ADV[~dropped]).sum() / 20
    torch.testing.assert_close(loss, manual)
    assert metrics["is/dropped_frac"] == pytest.approx(4 / 9)
    assert metrics["tokens"] == 9 and math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()


def test_truncated_is_weights():
    logp, engine = make_logprobs()
    cfg = LossConfig(is_mode="truncate", is_max=2.0)
    loss, metrics = grpo_loss(logp, engine, ADV, cfg, num_loss_tokens=9)
    loss.backward()
    r = RATIOS.clamp(max=math.exp(20.0))  # the loss caps the log-ratio at 20 against exp overflow
    weight = (2.0 / r).clamp(max=1.0)
    per_token = -torch.minimum(r * ADV, r.clamp(0.8, 1.28) * ADV)
    torch.testing.assert_close(loss, (per_token * weight).sum() / 9)
    # A negative-advantage token far above is_max: gradient -A * ratio * (is_max / ratio) / N, bounded.
    torch.testing.assert_close(logp.grad[6], -ADV[6] * 2.0 / 9)
    assert metrics["is/dropped_frac"] == pytest.approx(3 / 9)  # ratios 2.5, 10, 1e12 truncated


def test_ppo_clip_zeroes_gradient_and_is_counted():
    ratios = torch.tensor([1.5, 1.5, 0.6, 0.6, 1.1])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    logp = torch.zeros(5, requires_grad=True)
    loss, metrics = grpo_loss(logp, -torch.log(ratios), adv, LossConfig(is_min=0.0, is_max=10.0), 5)
    loss.backward()
    # Clipped: positive advantage above 1 + eps_high, negative advantage below 1 - eps_low.
    assert logp.grad[0] == 0 and logp.grad[3] == 0
    assert (logp.grad[[1, 2, 4]] != 0).all()
    assert metrics["clip/high"] == pytest.approx(0.2) and metrics["clip/low"] == pytest.approx(0.2)
    assert metrics["is/clipfrac"] == pytest.approx(0.4)


def test_kl_and_mismatch_metrics():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    engine = torch.tensor([-1.2, -1.5, -0.5])
    _, metrics = grpo_loss(logp, engine, torch.ones(3), LossConfig(), num_loss_tokens=3)
    d = logp - engine
    assert metrics["mismatch/kl"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-6)
    assert metrics["mismatch/logprob_diff_mean"] == pytest.approx(0.7 / 3, rel=1e-6)
    assert metrics["mismatch/logprob_diff_max"] == pytest.approx(0.5, rel=1e-6)
    assert metrics["is/ratio_mean"] == pytest.approx(float(d.exp().mean()), rel=1e-6)


@pytest.mark.parametrize("read", [True, False], ids=["read", "on_device"])
def test_micro_batches_sum_to_the_whole_batch(read):
    """Also with the metrics left on the device (``read_metrics=False``, as train_step runs): 0-dim tensors that
    the accumulator reduces and reads once, to the same numbers."""
    torch.manual_seed(5)
    n = 13
    logp = torch.randn(n).clamp(max=-0.1).requires_grad_()
    engine = logp.detach() + 0.8 * torch.randn(n)
    adv = torch.randn(n)
    cfg = LossConfig()
    whole, whole_metrics = grpo_loss(logp, engine, adv, cfg, num_loss_tokens=n)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    acc = MetricAccumulator()
    total = 0.0
    for part in (slice(0, 5), slice(5, n)):
        loss, metrics = grpo_loss(logp[part], engine[part], adv[part], cfg, num_loss_tokens=n, read_metrics=read)
        assert all(isinstance(v, float) != (not read) for k, v in metrics.items() if k != "tokens")
        total = total + loss
        acc.add(metrics)
    (split_grad,) = torch.autograd.grad(total, logp)
    torch.testing.assert_close(total, whole)
    torch.testing.assert_close(split_grad, whole_grad)
    reduced = acc.reduce()
    assert reduced.keys() == whole_metrics.keys()
    for key, value in whole_metrics.items():
        assert isinstance(reduced[key], (int, float)), key
        assert reduced[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert whole_metrics["is/dropped_frac"] > 0 and whole_metrics["is/clipfrac"] > 0  # both paths exercised
