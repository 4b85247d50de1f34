"""fp32-master AdamW: parity with torch.optim.AdamW, exact bf16 write-back and changed masks."""

import math
from itertools import pairwise

import pytest
import torch

from unison.train.optimizer import MasterAdamW, OptimConfig, lr_at

SHAPES = {"w1": (32, 24), "b1": (24,), "w2": (16, 32)}


def test_config_validation_names_the_field():
    for kwargs, field in [({"lr": -1.0}, "lr"), ({"beta1": 1.0}, "beta1"), ({"beta2": -0.1}, "beta2"),
                          ({"eps": 0.0}, "eps"), ({"weight_decay": -1.0}, "weight_decay"),
                          ({"max_grad_norm": -1.0}, "max_grad_norm"), ({"schedule": "linear"}, "schedule"),
                          ({"warmup_steps": -1}, "warmup_steps"), ({"min_lr_ratio": 2.0}, "min_lr_ratio")]:
        with pytest.raises(ValueError, match=field):
            OptimConfig(**kwargs)
    with pytest.raises(ValueError, match="total_steps"):
        MasterAdamW([], OptimConfig(schedule="cosine", warmup_steps=5), total_steps=5)


def test_schedules():
    assert [lr_at(s, OptimConfig(lr=1.0), 10) for s in (0, 9, 50)] == [1.0, 1.0, 1.0]
    warm = OptimConfig(lr=1.0, schedule="warmup", warmup_steps=4)
    assert [lr_at(s, warm, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = OptimConfig(lr=2.0, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    lrs = [lr_at(s, cos, 7) for s in range(9)]
    # Warmup 1.0, 2.0; cosine from 2.0 at step 2 to 0.2 at step 6 (the last), then held.
    assert lrs[:3] == [1.0, 2.0, 2.0]
    assert lrs[4] == pytest.approx(0.2 + 1.8 * 0.5)
    assert lrs[6] == pytest.approx(0.2) and lrs[8] == pytest.approx(0.2)
    assert all(a >= b for a, b in pairwise(lrs[1:]))


def make_params(dtype: torch.dtype, scale: float = 1.0) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.nn.Parameter((torch.randn(s, generator=gen) * scale).to(dtype)) for n, s in SHAPES.items()}


def set_grads(params: dict[str, torch.nn.Parameter], step: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params.values():
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.device, p.dtype)


def test_matches_torch_adamw_fp32():
    cfg = OptimConfig(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, max_grad_norm=5.0,
                      schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    steps = 6
    ours, ref = make_params(torch.float32), make_params(torch.float32)
    ptrs = {n: p.data_ptr() for n, p in ours.items()}
    opt = MasterAdamW(ours.items(), cfg, total_steps=steps)
    torch_opt = torch.optim.AdamW(ref.values(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, foreach=False)
    clipped = 0
    for step in range(steps):
        scale = 1.0 if step % 2 else 0.1  # alternate: norm ~36 (clipped) and ~3.6 (not)
        set_grads(ours, step, scale)
        set_grads(ref, step, scale)
        stats = opt.step()
        # The reference schedule, written out independently of lr_at.
        if step < 2:
            expected_lr = cfg.lr * (step + 1) / 2
        else:
            expected_lr = cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - 2) / 3)))
        assert opt.last_lr == stats.lr == pytest.approx(expected_lr, rel=1e-12)
        torch_norm = torch.nn.utils.clip_grad_norm_(ref.values(), cfg.max_grad_norm)
        assert stats.grad_norm == pytest.approx(float(torch_norm), rel=1e-6)
        clipped += stats.grad_norm > cfg.max_grad_norm
        for group in torch_opt.param_groups:
            group["lr"] = expected_lr
        torch_opt.step()
        for n in ours:
            torch.testing.assert_close(opt.state[n].master, ref[n].detach(), rtol=5e-7, atol=1e-7)
            assert torch.equal(ours[n].detach(), opt.state[n].master)  # fp32 params: exact copies
            assert ours[n].data_ptr() == ptrs[n]
            assert opt.state[n].master.data_ptr() != ptrs[n]  # a separate master even in fp32
        opt.zero_grad()
        assert all(p.grad is None for p in ours.values())
    assert 0 < clipped < steps


def test_bf16_write_back_and_exact_changed_masks():
    cfg = OptimConfig(lr=1e-5, weight_decay=0.01, schedule="warmup", warmup_steps=2)
    params = make_params(torch.bfloat16, scale=0.01)
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    opt = MasterAdamW(params.items(), cfg, total_steps=5)
    for step in range(5):
        set_grads(params, step, scale=1.0)
        snapshot = {n: p.detach().clone() for n, p in params.items()}
        stats = opt.step()
        changed = 0
        for n, p in params.items():
            assert p.dtype == torch.bfloat16 and p.data_ptr() == ptrs[n]
            assert torch.equal(p.detach().view(torch.int16), opt.state[n].master.to(torch.bfloat16).view(torch.int16))
            diff = p.detach().view(torch.int16) != snapshot[n].view(torch.int16)
            assert torch.equal(opt.changed_masks[n], diff)
            changed += int(diff.sum())
        total = sum(p.numel() for p in params.values())
        assert stats.num_changed == changed and stats.changed_fraction == changed / total
        assert 0.0 < stats.changed_fraction < 1.0
        opt.zero_grad()


def test_params_without_grad_are_skipped():
    params = make_params(torch.float32)
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    opt = MasterAdamW([*params.items(), ("frozen", frozen), ("w1_tied", params["w1"])],
                      OptimConfig(lr=1e-2, weight_decay=0.5), total_steps=1)
    assert list(opt.params) == ["w1", "b1", "w2"]  # frozen dropped, the tied duplicate once
    before = params["b1"].detach().clone()
    params["w1"].grad = torch.ones(SHAPES["w1"])
    params["w2"].grad = torch.ones(SHAPES["w2"])
    opt.step()
    assert torch.equal(params["b1"].detach(), before)  # no grad: not even weight decay
    assert set(opt.changed_masks) == {"w1", "w2"} and opt.changed_masks["w1"].all()


def test_non_finite_grad_norm_raises_before_touching_state():
    params = make_params(torch.float32)
    opt = MasterAdamW(params.items(), OptimConfig(), total_steps=1)
    before = {n: p.detach().clone() for n, p in params.items()}
    set_grads(params, 0, 1.0)
    params["b1"].grad[3] = float("nan")
    with pytest.raises(FloatingPointError, match="non-finite"):
        opt.step()
    assert opt.step_count == 0
    assert all(torch.equal(params[n].detach(), before[n]) for n in params)
