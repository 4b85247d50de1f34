"""loss.type, scale_rewards, truncation masking, the reference KL, entropy and num_iterations, each against its
formula written out here with plain Python loops over a hand batch (TRL's GRPOTrainer definitions)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import tiny_llama
from test_train_e2e import run_cfg, task

from unison.rollout.advantage import batch_scaled, group_advantages
from unison.rollout.loop import RolloutConfig
from unison.rollout.sample import Sample
from unison.train.logprobs import policy_logprobs
from unison.train.loop import train
from unison.train.loss import LossConfig, grpo_loss, loss_divisor
from unison.train.memory import plan_memory
from unison.train.optimizer import MasterAdamW, OptimConfig
from unison.train.packing import pack_samples
from unison.train.reference import ReferenceModel, build_reference
from unison.train.step import train_step

# A hand batch of three sequences in two micro-batches: [seq 0, seq 1] and [seq 2]. Per token: the trainer's
# logprob, the engine's, the reference's; per sequence: the advantage.
LP = [[-1.0, -2.0, -0.5], [-1.5, -0.2], [-3.0, -1.0, -2.0, -0.7]]
ENG = [[-1.1, -1.6, -0.5], [-1.3, -1.9], [-2.9, -1.2, -2.4, -0.1]]
OLD = [[-1.05, -1.9, -0.6], [-1.4, -0.3], [-3.1, -1.0, -2.1, -0.8]]
REF = [[-0.9, -2.2, -0.4], [-1.5, -0.5], [-2.5, -1.1, -2.0, -1.0]]
ADV = [1.0, -0.5, 2.0]
ROWS = [[0, 1], [2]]
MAX_LEN = 8


def _formula(loss_type: str, cfg: LossConfig, lp, old=None, ref=None, replicas: int = 1):
    """The step's loss from the definitions, token by token (lp: nested lists of 0-d tensors)."""
    n_seq, n_tok = len(lp), sum(len(s) for s in lp)
    total = 0.0
    for i, seq in enumerate(lp):
        a = ADV[i]
        base = ENG[i] if old is None else old[i]
        if loss_type == "gspo":
            s = torch.exp(sum(seq[t] - base[t] for t in range(len(seq))) / len(seq))
            if old is None:  # the engine correction at the sequence level, on s
                mask = float(cfg.is_min <= s.item() <= cfg.is_max)
                w = mask if cfg.is_mode == "mask" else min(1, cfg.is_max / s.item())
            else:
                r_is = math.exp(sum(old[i][t] - ENG[i][t] for t in range(len(seq))) / len(seq))
                w = r_is * float(cfg.is_min <= r_is <= cfg.is_max) if cfg.is_mode == "mask" else min(r_is, cfg.is_max)
            clipped = torch.clamp(s, 1 - cfg.eps_low, 1 + cfg.eps_high)
            total = total + -torch.minimum(s * a, clipped * a) * w / n_seq  # its mean over tokens is itself
            continue
        seq_sum = 0.0
        for t, x in enumerate(seq):
            r = torch.exp(x - base[t])
            if old is None:
                mask = float(cfg.is_min <= r.item() <= cfg.is_max)
                w = mask if cfg.is_mode == "mask" else min(1.0, cfg.is_max / r.item())
            else:
                r_is = math.exp(old[i][t] - ENG[i][t])
                w = r_is * float(cfg.is_min <= r_is <= cfg.is_max) if cfg.is_mode == "mask" else min(r_is, cfg.is_max)
            if loss_type == "cispo":
                term = -min(r.item(), cfg.eps_high) * a * x * w
            else:
                term = -torch.minimum(r * a, torch.clamp(r, 1 - cfg.eps_low, 1 + cfg.eps_high) * a) * w
            if ref is not None:
                d = ref[i][t] - x
                term = term + cfg.beta * (torch.exp(d) - d - 1)
            seq_sum = seq_sum + term
        if loss_type == "grpo":
            total = total + seq_sum / len(seq) / n_seq
        elif loss_type == "dr_grpo":
            total = total + seq_sum / (n_seq * MAX_LEN)
        elif loss_type == "bnpo":
            total = total + seq_sum / (n_tok * replicas)
        else:  # dapo, cispo
            total = total + seq_sum / n_tok
    return total


def _implementation(loss_type, cfg, lp, old=None, ref=None, replicas=1):
    n_seq, n_tok = len(lp), sum(len(s) for s in lp)
    total, metrics = 0.0, []
    flat = lambda xs, idx: torch.tensor([v for i in idx for v in xs[i]])  # noqa: E731
    for idx in ROWS:
        seq_lens = [len(lp[i]) for i in idx]
        logp = torch.stack([x for i in idx for x in lp[i]])
        adv = torch.tensor([ADV[i] for i in idx for _ in lp[i]])
        divisor = loss_divisor(loss_type, seq_lens, n_tok, n_seq, n_tok, replicas, MAX_LEN)
        loss, m = grpo_loss(logp, flat(ENG, idx), adv, cfg, n_tok, divisor=divisor, seq_lens=seq_lens,
                            old_logprobs=None if old is None else flat(old, idx),
                            ref_logprobs=None if ref is None else flat(ref, idx))
        total = total + loss
        metrics.append(m)
    return total, metrics


def _leaves():
    return [[torch.tensor(x, requires_grad=True) for x in seq] for seq in LP]


def _check(loss_type, cfg, **kw):
    lp_a, lp_b = _leaves(), _leaves()
    got, metrics = _implementation(loss_type, cfg, lp_a, **kw)
    want = _formula(loss_type, cfg, lp_b, **kw)
    got.backward()
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6, abs=1e-7)
    for sa, sb in zip(lp_a, lp_b, strict=True):
        for a, b in zip(sa, sb, strict=True):
            assert a.grad.item() == pytest.approx(b.grad.item(), rel=1e-5, abs=1e-7)
    assert any(a.grad.item() != 0 for s in lp_a for a in s)
    return got.item(), metrics


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo", "gspo", "cispo"])
@pytest.mark.parametrize("is_mode", ["mask", "truncate"])
def test_each_loss_type_matches_its_formula(loss_type, is_mode):
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    cfg = LossConfig(type=loss_type, is_mode=is_mode, is_max=1.5, eps_high=eps_high)
    _check(loss_type, cfg)


def test_the_losses_differ_in_normalisation_as_defined():
    values = {t: _check(t, LossConfig(type=t, eps_high=5.0 if t == "cispo" else 0.28, is_max=100.0, is_min=0.0))[0]
              for t in ("dapo", "grpo", "dr_grpo", "bnpo")}
    assert values["bnpo"] == pytest.approx(values["dapo"])  # one replica: the local batch is the global one
    assert len({round(values[t], 6) for t in ("dapo", "grpo", "dr_grpo")}) == 3
    # bnpo over two replicas: each replica's share halves (their gradients are summed)
    got, _ = _implementation("bnpo", LossConfig(type="bnpo", is_max=100.0, is_min=0.0), _leaves(), replicas=2)
    assert got.item() == pytest.approx(values["bnpo"] / 2)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "gspo", "cispo"])
@pytest.mark.parametrize("is_mode", ["mask", "truncate"])
def test_later_iterations_ratio_against_old_logprobs_with_fixed_engine_correction(loss_type, is_mode):
    cfg = LossConfig(type=loss_type, is_mode=is_mode, is_max=1.2, eps_high=5.0 if loss_type == "cispo" else 0.28)
    _check(loss_type, cfg, old=OLD)


def test_k3_kl_to_the_reference_is_added_with_beta_and_logged():
    cfg = LossConfig(beta=0.3)
    _, metrics = _check("dapo", cfg, ref=REF)
    k3 = [math.exp(REF[i][t] - LP[i][t]) - (REF[i][t] - LP[i][t]) - 1 for i in ROWS[0] for t in range(len(LP[i]))]
    assert metrics[0]["kl/ref_mean"] == pytest.approx(sum(k3) / len(k3), rel=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _implementation("dapo", cfg, _leaves())


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="loss.type"):
        from unison.config import load_config
        from unison.train.config import TrainConfig
        load_config(TrainConfig, None, ["--loss.type=ppo"])
    with pytest.raises(ValueError, match="eps_high"):
        LossConfig(type="cispo")  # eps_high is the IS cap itself for cispo: 0.28 would be a mistake
    with pytest.raises(ValueError, match="beta"):
        LossConfig(beta=-1.0)
    with pytest.raises(ValueError, match="scale_rewards"):
        RolloutConfig(scale_rewards="std")
    with pytest.raises(ValueError, match="max_completion_length"):
        loss_divisor("dr_grpo", [3], 3, 1, 3, 1, 0)


def test_scale_rewards_group_batch_none():
    rewards = [0.0, 1.0, 1.0, 3.0]
    mean = sum(rewards) / 4
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4)
    assert group_advantages(rewards, 1e-6, "group") == pytest.approx([(r - mean) / (std + 1e-6) for r in rewards])
    assert group_advantages(rewards, 1e-6, "none") == pytest.approx([r - mean for r in rewards])
    assert group_advantages([2.0, 2.0], 1e-6, "none") is None  # no signal whatever the scaling
    # batch: two groups centred on their own means, divided by the std of all eight rewards
    other = [5.0, 7.0, 5.0, 7.0]
    centred = group_advantages(rewards, 1e-6, "batch") + group_advantages(other, 1e-6, "batch")
    everything = rewards + other
    m = sum(everything) / 8
    batch_std = math.sqrt(sum((r - m) ** 2 for r in everything) / 8)
    want = [(r - mean) / (batch_std + 1e-6) for r in rewards] + [(r - 6.0) / (batch_std + 1e-6) for r in other]
    got = batch_scaled(centred, sum(everything), sum(r * r for r in everything), 8)
    assert got == pytest.approx(want)


def _samples(finish_last: str = "stop") -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (p, c, adv) in enumerate([(4, 5, 1.0), (3, 7, -1.0), (5, 4, 0.5), (2, 6, -0.5)]):
        ids = torch.randint(3, 256, (p + c,), generator=g).tolist()
        eng = (-torch.rand(c, generator=g) * 3 - 2.5).tolist()
        out.append(Sample(tuple(ids[:p]), tuple(ids[p:]), tuple(eng), (0,) * c, reward=float(i), advantage=adv,
                          finish_reason=finish_last if i == 3 else "stop"))
    return out


def _step(samples, cfg=None, lr=1e-2, **kw):
    cfg = cfg or LossConfig()
    model = tiny_llama()
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=lr), total_steps=10)
    metrics = train_step(model, opt, samples, cfg, 1.0, 64, 0, 4, **kw)
    return model, opt, metrics


def test_truncated_completions_are_masked_out_of_the_loss():
    samples = _samples(finish_last="length")
    masked, _, m = _step(samples, LossConfig(mask_truncated_completions=True))
    without, _, _ = _step(samples[:3])
    kept, _, _ = _step(samples)
    assert m["train/masked_truncated"] == 1.0 and m["train/loss_tokens"] == 5 + 7 + 4
    for a, b in zip(masked.parameters(), without.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # dapo: the same update as without the sample
    assert any(not torch.equal(a, c) for a, c in zip(masked.parameters(), kept.parameters(), strict=True))


def test_policy_entropy_is_the_full_softmax_entropy():
    samples = _samples()
    model, _, m = _step(samples, lr=0.0)
    fresh = tiny_llama()
    entropies = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = fresh(ids).logits[0, len(s.prompt_ids) - 1:-1].float()
            logp = torch.log_softmax(logits, -1)
            entropies += (-(logp.exp() * logp).sum(-1)).tolist()
    assert m["policy/entropy_mean"] == pytest.approx(sum(entropies) / len(entropies), rel=1e-5)


def test_num_iterations_takes_that_many_steps_against_the_first_iterations_logprobs():
    samples = _samples()
    cfg = LossConfig(is_max=100.0, is_min=0.0)
    twice, opt, m = _step(samples, cfg, lr=3e-2, num_iterations=2)
    assert opt.step_count == 2 and m["train/iterations"] == 2.0
    # The same by hand: one step, then one more with the pre-update logprobs as the ratio's denominator.
    model = tiny_llama()
    hand = MasterAdamW(model.named_parameters(), OptimConfig(lr=3e-2), total_steps=10)
    rows = pack_samples(samples, 64, 0)
    with torch.no_grad():
        old = [policy_logprobs(model, row, chunk_size=4)[0] for row in rows]
    train_step(model, hand, samples, cfg, 1.0, 64, 0, 4)
    n = sum(len(s.completion_ids) for s in samples)
    for row, old_lp in zip(rows, old, strict=True):
        logp, _ = policy_logprobs(model, row, chunk_size=4)
        m_ = row.loss_mask
        loss, _ = grpo_loss(logp, row.engine_logprobs[m_], row.advantages[m_], cfg, n, old_logprobs=old_lp)
        loss.backward()
    hand.step()
    for a, b in zip(twice.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    once, _, _ = _step(samples, cfg, lr=3e-2)
    assert any(not torch.allclose(a, b) for a, b in zip(twice.parameters(), once.parameters(), strict=True))


@pytest.mark.parametrize("on_host", [False, True])
def test_reference_is_the_frozen_initial_policy(on_host):
    model = tiny_llama()
    initial = copy.deepcopy(model)
    assert build_reference(model, 0.0, on_host, False) is None  # beta 0: no reference model
    ref = build_reference(model, 0.1, on_host, False)
    params = [p for p in model.parameters()]
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn_like(p))  # the policy moves on
    (row,) = pack_samples(_samples(), 64, 0)
    want, _ = policy_logprobs(initial, row, chunk_size=4)
    torch.testing.assert_close(ref.logprobs(row, chunk_size=4), want.detach(), rtol=1e-6, atol=1e-6)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))  # the policy's own parameters are back
    now, _ = policy_logprobs(model, row, chunk_size=4)
    assert not torch.allclose(now, want)
    assert isinstance(ref, ReferenceModel) and ref.nbytes == sum(p.numel() * 4 for p in model.parameters())


def test_memory_plan_counts_the_reference():
    model = tiny_llama()
    args = (model, 0, True, False, 64, 4, False)
    names = lambda plan: {what: gib for what, gib, _ in plan.rows}  # noqa: E731
    assert "reference model" not in names(plan_memory(*args))
    weights = sum(p.numel() * 4 for p in model.parameters()) / 2**30
    assert names(plan_memory(*args, reference="device"))["reference model"] == pytest.approx(weights)
    assert 0 < names(plan_memory(*args, reference="host"))["reference model"] < weights


def test_train_with_beta_and_dapo_end_to_end(model_dir, tmp_path):
    out = tmp_path / "kl"
    last = train(run_cfg(model_dir, out, "--optim.lr=1e-3", "--loss.type=dapo", "--loss.beta=0.05",
                         "--max_steps=2"), task())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["kl/ref_mean"] == pytest.approx(0.0, abs=1e-6)  # the first step: policy = reference
    assert records[1]["kl/ref_mean"] > 0  # after an update the policy has moved away from it
    assert last["policy/entropy_mean"] > 0
