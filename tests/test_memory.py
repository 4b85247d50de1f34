"""Memory: lending the KV pool, optimizer state in host memory, activation checkpointing, the memory plan."""

from __future__ import annotations

import pytest
import torch
from conftest import max_logprob_diff, random_prompts, tiny_llama
from test_optimizer import make_params, set_grads

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.train.memory import (
    MemoryConfig,
    MemoryPlan,
    auto_row_tokens,
    choose_lending,
    explain_oom,
    kv_blocks_for,
    plan_memory,
)
from unison.train.optimizer import MasterAdamW, OptimConfig, build_optimizer
from unison.train.state_store import HostStore


def seeded_run(lend_after: int | None, prefix_caching: bool = True):
    """Seeded samples of 4 prompts; optionally lend the pool away (and back) after ``lend_after`` steps."""
    model = tiny_llama()
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, max_batch_tokens=32, seed=0,
                                        prefix_caching=prefix_caching))
    for i, prompt in enumerate(random_prompts([5, 9, 3, 12])):
        engine.submit(prompt, SamplingParams(max_new_tokens=20, n=2, seed=i, stop_token_ids=()))
    done, steps = [], 0
    while engine.num_unfinished:
        if steps == lend_after:
            pool_bytes = engine.pool.nbytes
            with engine.lend() as lent:
                assert lent == pool_bytes
                assert engine.pool.storage.untyped_storage().nbytes() == 0  # the memory is really gone
                with pytest.raises(RuntimeError, match="lent"):
                    engine.step()
                torch.empty(pool_bytes // 4)  # the borrower uses it
        done += engine.step()
        steps += 1
    return model, engine, sorted(done, key=lambda c: c.request_id)


def test_lending_changes_no_completion():
    """In-flight requests lose their KV and recompute it; seeded sampling gives the same tokens, and logprobs
    equal to a teacher-forced forward."""
    _, _, plain = seeded_run(None)
    model, engine, lent = seeded_run(lend_after=7)
    assert engine.stats()["kv_lent_bytes"] == engine.pool.nbytes
    for a, b in zip(plain, lent, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    assert max_logprob_diff(model, lent) < 1e-4


def test_lending_reports_the_kv_it_drops():
    """What a lend reports as dropped is the work it adds: without the prefix cache (whose hits would spare some
    of it), exactly the tokens recomputed afterwards."""
    _, plain, _ = seeded_run(None, prefix_caching=False)
    _, lent, _ = seeded_run(lend_after=7, prefix_caching=False)
    dropped = lent.stats()["kv_dropped_tokens"]
    assert dropped > 0 and lent.stats()["tokens_computed"] - plain.stats()["tokens_computed"] == dropped


@pytest.mark.parametrize("chunk", [7, 10_000])
def test_host_placement_is_bit_identical(chunk):
    """State in host memory (chunks of 7 elements: every parameter is cut, chunks cross nothing) equals state on
    the device bit for bit over 10 steps, clipping and weight decay included, and so do the changed masks."""
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, schedule="cosine", warmup_steps=2)
    a, b = make_params(torch.bfloat16), make_params(torch.bfloat16)
    gpu_opt = MasterAdamW(a.items(), cfg, total_steps=10)
    host_opt = MasterAdamW(b.items(), cfg, total_steps=10, store=HostStore(chunk_numel=chunk, in_flight=2))
    for step in range(10):
        set_grads(a, step, 1.0 if step % 3 else 50.0)
        set_grads(b, step, 1.0 if step % 3 else 50.0)
        sa, sb = gpu_opt.step(), host_opt.step()
        assert sa == sb
        for name in a:
            assert torch.equal(a[name].view(torch.int16), b[name].view(torch.int16)), (step, name)
            assert torch.equal(gpu_opt.changed_masks[name], host_opt.changed_masks[name])
            assert torch.equal(gpu_opt.state[name].exp_avg_sq, host_opt.state[name].exp_avg_sq)
    assert isinstance(build_optimizer(b.items(), OptimConfig(placement="host"), 1).store, HostStore)
    with pytest.raises(ValueError, match="placement"):
        OptimConfig(placement="disk")


def test_memory_plan_and_oom_advice():
    model = tiny_llama()
    assert kv_blocks_for(64, 100, 28, 16) == 64 * (8 + 1)
    plan = plan_memory(model, kv_pool_bytes=2**30, optimizer_on_gpu=True, lend_kv=False, max_tokens_per_row=4096,
                       logprob_chunk=1024, activation_checkpointing=False)
    rows = {what: gib for what, gib, _ in plan.rows}
    params = sum(p.numel() for p in model.parameters())
    assert rows["optimizer (fp32 state)"] == pytest.approx(12 * params / 2**30)
    assert rows["KV pool"] == 1.0 and "KV pool" in plan.table()
    host = plan_memory(model, 2**30, optimizer_on_gpu=False, lend_kv=True, max_tokens_per_row=4096,
                       logprob_chunk=1024, activation_checkpointing=True)
    host_rows = {what: gib for what, gib, _ in host.rows}
    assert host_rows["optimizer (fp32 state)"] == 0 and host.total_gib < plan.total_gib
    assert host_rows["activations (estimate)"] < rows["activations (estimate)"]
    message = str(explain_oom(torch.OutOfMemoryError("CUDA out of memory"), plan, "step 3"))
    assert "step 3" in message and "KV pool" in message and "max_concurrent_rollouts" in message
    with pytest.raises(ValueError, match="num_blocks"):
        Engine(model, EngineConfig(num_blocks=0))


def test_auto_row_tokens_takes_the_longest_row_that_fits():
    """step.max_tokens_per_row=0: the real plan of a model, placed on GPUs of several sizes."""
    from unison.train.config import StepConfig

    model = tiny_llama()
    base = plan_memory(model, 0, True, False, 0, 1024, False).total_gib
    per_token = (plan_memory(model, 0, True, False, 1, 1024, False).total_gib - base)

    def on(device_gib):
        def plan_for(tokens):
            plan = plan_memory(model, 0, True, False, tokens, 1024, False)
            return MemoryPlan(plan.rows, device_gib)
        return plan_for

    fits_8192 = (base + 8192 * per_token) / 0.85
    fits_16384 = (base + 16384 * per_token) / 0.85
    fits_24576 = (base + 24576 * per_token) / 0.85
    assert auto_row_tokens(on(fits_24576 * 1.01), 600) == 24576
    assert auto_row_tokens(on(fits_24576 * 0.99), 600) == 16384
    assert auto_row_tokens(on(fits_16384 * 1.01), 600) == 16384
    assert auto_row_tokens(on(fits_16384 * 0.99), 600) == 8192
    assert auto_row_tokens(on(fits_8192 * 1.01), 600) == 8192
    assert auto_row_tokens(on(fits_8192 * 0.99), 600) == 4096
    assert auto_row_tokens(on(base * 1.0001), 600) == 2048  # nothing fits: the shortest candidate
    assert auto_row_tokens(on(base * 1.0001), 3000) == 3000  # never shorter than the longest sample
    assert auto_row_tokens(lambda tokens: MemoryPlan(plan_memory(model, 0, True, False, tokens, 1024, False).rows,
                                                     None), 600) == 4096  # no GPU
    assert StepConfig().max_tokens_per_row == 0
    with pytest.raises(ValueError, match="0 \\(auto\\) or >= 2"):
        StepConfig(max_tokens_per_row=1)


def test_activation_checkpointing_recomputes_layers_and_keeps_dropout_off():
    from unison.train.step import checkpointed_layers

    model = tiny_llama()
    layer = model.model.layers[0]
    calls = []
    layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # a post-hook misses the early-stopped recompute
    ids = torch.tensor([random_prompts([12])[0]])
    grads = []
    for enabled in (False, True):
        calls.clear()
        model.zero_grad()
        with checkpointed_layers(model, enabled):
            assert not layer.self_attn.training and not model.training  # only the layers are flagged
            model(ids).logits.float().pow(2).mean().backward()
        grads.append(layer.mlp.up_proj.weight.grad.clone())
        assert len(calls) == (2 if enabled else 1)  # forward, then the recompute in backward
    assert not layer.training
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-6, atol=1e-8)


def test_auto_lends_the_kv_pool_only_where_the_plan_needs_it():
    """auto keeps the pool when keeping it fits with rows as long as lending's; always/never as set; the CPU never."""
    def plans(kept_gib: float, kept_rows: int):
        table = {True: (MemoryPlan([("KV pool", 10.0, "lent")], 100.0), 8192),
                 False: (MemoryPlan([("KV pool", kept_gib, "")], 100.0), kept_rows)}
        asked = []

        def plan_for(lend: bool):
            asked.append(lend)
            return table[lend]
        return plan_for, asked

    plan_for, _ = plans(80.0, 8192)
    assert choose_lending("auto", True, plan_for)[0] is False  # 80 GiB of 100 fits in 85%
    plan_for, _ = plans(90.0, 8192)
    assert choose_lending("auto", True, plan_for)[0] is True  # it does not
    plan_for, _ = plans(50.0, 4096)
    lend, plan, rows = choose_lending("auto", True, plan_for)
    assert lend and rows == 8192  # keeping it would halve the rows
    table = {True: (MemoryPlan([("KV pool", 10.0, "lent")], 100.0), 16384),
             False: (MemoryPlan([("KV pool", 50.0, "")], 100.0), 8192)}
    assert choose_lending("auto", True, table.get)[0] is False  # rows beyond 8192 are not worth lending for
    plan_for, asked = plans(50.0, 8192)
    assert choose_lending("always", True, plan_for)[:1] == (True,) and asked == [True]
    plan_for, asked = plans(50.0, 8192)
    assert choose_lending("never", False, plan_for)[:1] == (False,) and asked == [False]
    assert MemoryConfig(lend_kv="auto").lends(torch.device("cpu")) is False


def test_activation_estimate_counts_the_attention_widths():
    """Qwen3's attention is wider than its hidden size (0.6B: 16 x 128 query and 8 x 128 key/value heads at 1024):
    the estimate counts q, k, v, v's copy and the output at their own widths (an H200's measured GRPO peaks grew
    40.3 and 72.1 KiB a token a layer at 0.6B and 1.7B; the hidden-size-only estimate said 30 and 60)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    def activations(head_dim: int, **shape) -> float:
        cfg = Qwen3Config(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2), **shape}, head_dim=head_dim)
        with torch.device("meta"):
            model = Qwen3ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
        rows = {what: gib for what, gib, _ in plan_memory(model, 0, True, False, 1024, 64, False).rows}
        return rows["activations (estimate)"] * 2**30

    # per token and layer: q (4 heads) and k, v, v's copy (2 heads each) at head_dim, bf16
    assert activations(64) - activations(16) == 1024 * 2 * 2 * (4 + 3 * 2) * (64 - 16)
    qwen3_06b = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8)
    assert activations(128, **qwen3_06b) / 1024 / 28 == 40 * 1024  # bytes a token a layer
