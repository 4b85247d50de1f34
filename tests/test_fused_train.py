"""The trainer's fused kernels (unison.train.fused, unison.train.triton_logprobs) in Triton's interpreter: each
against the PyTorch function it replaces, forward and backward, then whole models and a train_step with and
without them."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3
from test_logprobs import packed_row
from transformers.models.qwen3 import modeling_qwen3

from unison.engine.lm_head import HeadTransform
from unison.train.logprobs import chunked_logprobs, full_logprobs_reference, policy_logprobs

pytest.importorskip("triton")

from unison.train import fused, triton_logprobs  # noqa: E402


def _grads(fn, *inputs, upstream):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    sum((o * u).sum() for o, u in zip(outs, upstream, strict=True)).backward()
    return [o.detach() for o in outs], [t.grad for t in inputs]


@pytest.mark.parametrize("shape", [(37, 64), (1, 5, 3, 32)], ids=["hidden", "heads"])
def test_rms_norm_forward_and_backward_equal_transformers(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * 3
    norm = modeling_qwen3.Qwen3RMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    upstream = [torch.randn(*shape, generator=g)]

    def reference(x, w):
        return torch.func.functional_call(norm, {"weight": w}, (x,))

    (ref,), ref_grads = _grads(reference, x, norm.weight, upstream=upstream)
    (out,), grads = _grads(lambda x, w: fused.rms_norm(x, w, 1e-6), x, norm.weight, upstream=upstream)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0], ref_grads[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], ref_grads[1], rtol=1e-5, atol=1e-5)
    assert ref_grads[1].abs().max() > 1  # the weight's gradient is summed over every row


@pytest.mark.parametrize("parts,width", [(100, 200), (3, 128), (33, 7)])
def test_weight_gradient_parts_sum_in_one_kernel(parts, width):
    """The RMSNorm backward's per-program partial weight gradients, summed down the programs and rounded once:
    several row blocks of 32 and a column block of 128 with a ragged end each."""
    x = torch.randn(parts, width, generator=torch.Generator().manual_seed(parts)) * 10
    out = fused._sum_parts(x, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (width,)
    exact = x.double().sum(0)
    # One bf16 rounding (the interpreter truncates where the GPU rounds to nearest: 2^-8 relative, not 2^-9).
    torch.testing.assert_close(out.double(), exact, rtol=2**-7, atol=1e-4)
    torch.testing.assert_close(fused._sum_parts(x, torch.float32).double(), exact, rtol=1e-5, atol=1e-4)


def test_rope_forward_and_backward_equal_transformers():
    g = torch.Generator().manual_seed(1)
    bsz, heads, kv_heads, tokens, dim = 1, 4, 2, 9, 16
    # The trainer's layout: (B, T, H, D) projections viewed as (B, H, T, D).
    q = torch.randn(bsz, tokens, heads, dim, generator=g).transpose(1, 2)
    k = torch.randn(bsz, tokens, kv_heads, dim, generator=g).transpose(1, 2)
    freqs = torch.randn(bsz, tokens, dim // 2, generator=g)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    upstream = [torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)]
    ref, ref_grads = _grads(lambda q, k: modeling_qwen3.apply_rotary_pos_emb(q, k, cos, sin), q, k,
                            upstream=upstream)
    out, grads = _grads(lambda q, k: fused.rope(q, k, cos, sin), q, k, upstream=upstream)
    for a, b in zip(out + grads, ref + ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (6, 4, 32), (16, 8, 128)])
def test_qk_norm_rope_forward_and_backward_equal_transformers(heads, kv_heads, dim):
    """Qwen3's q/k norms and RoPE in one kernel (unison.train.fused_qk), against the modules and function it replaces:
    outputs and the gradients of q, k and both norms' weights; head counts that split across programs unevenly."""
    from unison.train.fused_qk import qk_norm_rope

    g = torch.Generator().manual_seed(heads * dim)
    tokens = 11
    q = torch.randn(tokens, heads, dim, generator=g) * 3
    k = torch.randn(tokens, kv_heads, dim, generator=g)
    freqs = torch.randn(tokens, dim // 2, generator=g)
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)
    q_norm, k_norm = modeling_qwen3.Qwen3RMSNorm(dim, eps=1e-6), modeling_qwen3.Qwen3RMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(dim, generator=g))
        k_norm.weight.copy_(torch.randn(dim, generator=g))
    upstream = [torch.randn(q.shape, generator=g), torch.randn(k.shape, generator=g)]

    def reference(q, k, wq, wk):  # transformers' layout: (1, H, T, D)
        qn = torch.func.functional_call(q_norm, {"weight": wq}, (q[None],)).transpose(1, 2)
        kn = torch.func.functional_call(k_norm, {"weight": wk}, (k[None],)).transpose(1, 2)
        qr, kr = modeling_qwen3.apply_rotary_pos_emb(qn, kn, cos[None], sin[None])
        return qr.transpose(1, 2)[0], kr.transpose(1, 2)[0]

    ref, ref_grads = _grads(reference, q, k, q_norm.weight, k_norm.weight, upstream=upstream)
    weights = q_norm.weight.detach().clone(), k_norm.weight.detach().clone()
    q_norm.weight.grad = k_norm.weight.grad = None
    out, grads = _grads(lambda q, k: qk_norm_rope(q, k, q_norm, k_norm, cos, sin), q, k, upstream=upstream)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads + [q_norm.weight.grad, k_norm.weight.grad], ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(q_norm.weight.detach(), weights[0]) and ref_grads[2].abs().max() > 1


def test_silu_mul_forward_and_backward_equal_pytorch():
    g = torch.Generator().manual_seed(2)
    gate, up = torch.randn(3, 700, generator=g) * 4, torch.randn(3, 700, generator=g)  # not a multiple of a block
    upstream = [torch.randn(3, 700, generator=g)]
    ref, ref_grads = _grads(lambda a, b: torch.nn.functional.silu(a) * b, gate, up, upstream=upstream)
    out, grads = _grads(fused.silu_mul, gate, up, upstream=upstream)
    for a, b in zip(out + grads, ref + ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="silu_mul"):
        fused.silu_mul(gate, up[:, :5])


@pytest.mark.parametrize("with_entropy", [True, False])
def test_logprob_chunk_kernels_equal_pytorch(with_entropy):
    g = torch.Generator().manual_seed(3)
    rows, vocab = 6, 300  # three blocks of 128, the last one partial
    z = torch.randn(rows, vocab, generator=g) * 8
    z[0, :] = 40.0 + torch.randn(vocab, generator=g) * 1e-3  # large, nearly equal logits: nothing may cancel
    targets = torch.randint(0, vocab, (rows,), generator=g)
    lse, logp, entropy = triton_logprobs.chunk_forward(z, targets, with_entropy, block=128)
    ref_lse = torch.logsumexp(z, -1)
    log_probs = z - ref_lse[:, None]
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(logp, log_probs.gather(1, targets[:, None]).squeeze(1), rtol=0, atol=1e-5)
    if with_entropy:
        torch.testing.assert_close(entropy, -(log_probs.exp() * log_probs).sum(-1), rtol=0, atol=1e-5)
        assert abs(entropy[0] - torch.log(torch.tensor(vocab, dtype=torch.float32))) < 1e-3  # ~uniform row
    else:
        assert entropy is None
    grad = torch.randn(rows, generator=g)
    dx = triton_logprobs.chunk_backward(z, targets, lse, grad, 0.5, torch.float32, block=128)
    expected = (torch.nn.functional.one_hot(targets, vocab) - log_probs.exp()) * grad[:, None] * 0.5
    torch.testing.assert_close(dx, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("transform", [HeadTransform(), HeadTransform(scale=0.25), HeadTransform(softcap=3.0)],
                         ids=["plain", "scale", "softcap"])
def test_chunked_logprobs_with_kernels_equal_reference(transform):
    torch.manual_seed(4)
    hidden = torch.randn(21, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (21,))
    upstream = torch.randn(21)
    logp, entropy = chunked_logprobs(hidden, weight, targets, 0.7, 8, with_entropy=True, transform=transform,
                                     kernels=True)
    (logp * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref_logp, ref_entropy = full_logprobs_reference(hidden, weight, targets, 0.7, transform)
    (ref_logp * upstream).sum().backward()
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], weight.grad, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("later", [False, True], ids=["first", "old+ref"])
@pytest.mark.parametrize("loss_type,is_mode", [(t, m) for t in ("dapo", "grpo", "dr_grpo", "bnpo", "cispo")
                                               for m in ("mask", "truncate")])
def test_chunked_loss_with_kernels_equals_the_recompute(loss_type, is_mode, later):
    """The gradient in the forward with each token's d loss / d logp taken inside the Triton backward kernel
    (``triton_logprobs._token_grad``): the logprobs bit for bit, the loss and both gradients as the kernels'
    logprobs, then ``grpo_loss``, then its backward give them, to fp32 rounding; for every token-separable loss,
    both IS modes, later iterations' fixed weight and the reference's KL, and log-ratios past the clamp."""
    from test_chunked_loss import CHUNK, _divisor, _inputs

    from unison.train.logprobs import chunked_loss
    from unison.train.loss import LossConfig, grpo_loss, token_loss

    cfg = LossConfig(type=loss_type, is_mode=is_mode, is_max=1.5, eps_high=5.0 if loss_type == "cispo" else 0.28,
                     beta=0.05 if later else 0.0)
    hidden, weight, targets, extra = _inputs(torch.float32)
    extra["engine"][:2] += torch.tensor([30.0, -30.0])  # log-ratios clamped at -20 and 20: no gradient through them
    args = dict(divisor=_divisor(loss_type), old_logprobs=extra["old"] if later else None,
                ref_logprobs=extra["ref"] if later else None)
    logp, _ = chunked_logprobs(hidden, weight, targets, 0.7, CHUNK, kernels=True)
    want_loss = grpo_loss(logp, extra["engine"], extra["advantages"], cfg, 100, **args)[0]
    want_loss.backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    share = token_loss(extra["engine"], extra["advantages"], cfg, 100, **args)
    loss, fused_logp, _ = chunked_loss(hidden, weight, targets, share, 0.7, CHUNK, kernels=True)
    loss.backward()
    assert torch.equal(fused_logp, logp.detach())
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-5, atol=1e-7)
    for got, exact in zip((hidden.grad, weight.grad), want, strict=True):
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-6 * exact.abs().max().item())
    assert want[1].abs().max() > 1e-4


def _logprobs_and_grads(model, row, kernels):
    model.zero_grad(set_to_none=True)
    logp, entropy = policy_logprobs(model, row, temperature=0.7, chunk_size=6, with_entropy=True, kernels=kernels)
    (logp * torch.linspace(-1.0, 1.0, logp.shape[0])).sum().backward()
    return logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_packed_forward_with_kernels_equals_transformers_modules(build, monkeypatch):
    """Logprobs, entropies and every parameter's gradient as transformers' modules give them; Qwen3's q/k norms and
    RoPE through the one kernel (fused_qk), in every layer."""
    from conftest import count_calls

    from unison.train import fused_qk

    calls = count_calls(monkeypatch, fused_qk, ["qk_norm_rope"])
    model = build(vocab=128)
    row = packed_row(model.config.vocab_size)
    logp, entropy, grads = _logprobs_and_grads(model, row, kernels=False)
    norms_before = {id(m): m.forward for m in model.modules()}
    fused_logp, fused_entropy, fused_grads = _logprobs_and_grads(model, row, kernels=True)
    assert calls["qk_norm_rope"] == (model.config.num_hidden_layers if build is tiny_qwen3 else 0)
    torch.testing.assert_close(fused_logp, logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(fused_entropy, entropy, rtol=0, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    assert {id(m): m.forward for m in model.modules()} == norms_before  # every module is itself again
    assert not hasattr(model, fused._ACTIVE)


def test_fused_training_switches_the_known_modules_and_nests():
    model = tiny_qwen3()
    layer = model.model.layers[0]
    original_rope = modeling_qwen3.apply_rotary_pos_emb
    with fused.fused_training(model):
        assert "forward" in layer.mlp.__dict__ and "forward" in layer.self_attn.q_norm.__dict__
        assert "forward" in layer.self_attn.__dict__  # q/k norms and RoPE in one kernel (fused_qk)
        assert modeling_qwen3.apply_rotary_pos_emb is not original_rope
        patched = layer.mlp.forward
        with fused.fused_training(model):  # nested: nothing switched again, nothing restored early
            assert layer.mlp.forward is patched
        assert layer.mlp.forward is patched
    assert "forward" not in layer.mlp.__dict__ and "forward" not in layer.self_attn.q_norm.__dict__
    assert "forward" not in layer.self_attn.__dict__
    assert modeling_qwen3.apply_rotary_pos_emb is original_rope
    assert len(fused.fused_mlps(model)) == model.config.num_hidden_layers


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_train_step_with_kernels_equals_without(checkpointing):
    """One train_step with the kernels (across activation checkpointing's recompute too) reaches the optimizer with
    the gradients and the loss the step without them has."""
    from test_losses import _samples

    from unison.train.loss import LossConfig
    from unison.train.optimizer import MasterAdamW, OptimConfig
    from unison.train.step import train_step

    runs = []
    for kernels in (False, True):
        model = tiny_qwen3()
        opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=1e-2), total_steps=10)
        grads, real_step = {}, opt.step

        def step(model=model, grads=grads, real_step=real_step):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return real_step()

        opt.step = step
        metrics = train_step(model, opt, _samples(), LossConfig(), 1.0, 64, 0, 4,
                             activation_checkpointing=checkpointing, kernels=kernels)
        runs.append((metrics, grads))
    (plain, plain_grads), (fused_metrics, fused_grads) = runs
    assert fused_metrics["loss"] == pytest.approx(plain["loss"], rel=1e-5, abs=1e-6)
    assert plain_grads.keys() == fused_grads.keys() and len(plain_grads) > 0
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        assert grad.abs().max() > 0, name


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_adamw_kernel_equals_pytorch(grad_dtype):
    """Three steps of the one-kernel AdamW and write-back against ``adamw_step`` / ``write_back``'s PyTorch
    operations: fp32 state within a rounding step, bf16 parameters and their changed masks bit for bit."""
    from unison.train import triton_adamw
    from unison.train.adamw import adamw_step, write_back

    g = torch.Generator().manual_seed(5)
    n = 5000  # three blocks, the last one partial
    master = torch.randn(n, generator=g)
    master[:2] = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8])  # two ties: to even, down and up
    states = [[master.clone(), torch.zeros(n), torch.zeros(n)] for _ in range(2)]
    params = [master.bfloat16() for _ in range(2)]
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in range(1, 4):
        grad = (torch.randn(n, generator=g) * 10 ** -step).to(grad_dtype)
        adamw_step(*states[0][:1], grad, *states[0][1:], step=step, grad_scale=0.5, kernel=False, **hp)
        triton_adamw.adamw_step(states[1][0], grad, states[1][1], states[1][2], grad_scale=0.5,
                                decay=1.0 - hp["lr"] * hp["weight_decay"], beta1=hp["beta1"], beta2=hp["beta2"],
                                step_size=hp["lr"] / (1.0 - hp["beta1"] ** step),
                                bc2_sqrt=(1.0 - hp["beta2"] ** step) ** 0.5, eps=hp["eps"])
        for ours, theirs in zip(states[1], states[0], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=2e-7, atol=1e-9)
        states[1][0].copy_(states[0][0])  # the same master into both write-backs
        changed = [write_back(params[0], states[0][0], kernel=False), triton_adamw.write_back(params[1], states[1][0])]
        assert torch.equal(params[1].view(torch.int16), params[0].view(torch.int16))
        assert torch.equal(changed[1], changed[0]) and 0 < int(changed[0].sum()) < n


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_one_launch_step_equals_the_per_tensor_kernels(grad_dtype):
    """``MultiTensorStep``: every tensor's AdamW update and write-back in one launch, equal to the per-tensor
    kernels (fp32 state bit for bit, bf16 parameters and changed masks too), over tensors of one, several and a
    partial chunk; the masks are views of one buffer of exactly their elements, so ``_count_true`` sums it once."""
    from unison.train import triton_adamw
    from unison.train.adamw import AdamWStep
    from unison.train.optimizer import _count_true

    g = torch.Generator().manual_seed(6)
    shapes = [(20000,), (3, 7), (1,), (300, 40)]  # chunks of 8192 elements: 3, 1, 1, 2 programs
    params = [[torch.randn(s, generator=g).bfloat16() for s in shapes]]
    params.append([p.clone() for p in params[0]])
    states = [[[p.float(), torch.zeros(p.shape), torch.zeros(p.shape)] for p in ps] for ps in params]
    multi = triton_adamw.MultiTensorStep(*([s[i] for s in states[1]] for i in range(3)), params[1])
    for step in range(1, 4):
        grads = [(torch.randn(s, generator=g) * 10 ** -step).to(grad_dtype) for s in shapes]
        scalars = AdamWStep(step, 1e-3, 0.9, 0.95, 1e-8, 0.1, grad_scale=0.5).kernel_scalars()
        masks = multi(grads, scalars)
        for i, grad in enumerate(grads):
            master, exp_avg, exp_avg_sq = states[0][i]
            triton_adamw.adamw_step(master, grad, exp_avg, exp_avg_sq, **scalars)
            changed = triton_adamw.write_back(params[0][i], master)
            for ours, theirs in zip(states[1][i], states[0][i], strict=True):
                assert torch.equal(ours, theirs)
            assert torch.equal(params[1][i].view(torch.int16), params[0][i].view(torch.int16))
            assert masks[i].shape == shapes[i] and torch.equal(masks[i], changed)
        assert {id(m._base) for m in masks} == {id(masks[0]._base)}
        assert _count_true(masks + [torch.ones(5, dtype=torch.bool)]) == sum(int(m.sum()) for m in masks) + 5 > 5


def test_one_launch_tables_stay_few_when_the_stepped_set_changes():
    """A new set of stepped tensors builds a new table; the store keeps a few, not one per set ever seen (an MoE
    expert that no token reached has no gradient, so the set can change every step)."""
    from unison.train.adamw import AdamState
    from unison.train.state_store import _MULTI_CACHE, DeviceStore

    store = DeviceStore()
    tensors = {f"w{i}": torch.zeros(4, dtype=torch.bfloat16) for i in range(8)}
    states = store.allocate(tensors)
    assert all(isinstance(s, AdamState) for s in states.values())
    for drop in range(8):  # each step one tensor without a gradient
        group = [(n, states[n], t, torch.zeros(4, dtype=torch.bfloat16)) for n, t in tensors.items() if n != f"w{drop}"]
        assert store._multi_step(group) is store._multi_step(group)  # the same set: the same table
        assert len(store._multi) <= _MULTI_CACHE


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_residual_adds_in_the_norms_change_no_bit(build, monkeypatch):
    """Each layer's two residual adds inside the norms after them (the forward's sum and norm one kernel, the
    backward's sum of the residual's two gradients inside the norm's backward kernel): in fp32 the same logprobs and
    every parameter's gradient, bit for bit, as the kernels without them; two fused adds a layer."""
    from conftest import count_calls

    model = build(vocab=128)
    row = packed_row(model.config.vocab_size)
    with fused.fused_training(model, adds=False):  # the inner block (policy_logprobs') switches nothing more
        logp, entropy, grads = _logprobs_and_grads(model, row, kernels=True)
    calls = count_calls(monkeypatch, fused, ["add_rms_norm"])
    fused_logp, fused_entropy, fused_grads = _logprobs_and_grads(model, row, kernels=True)
    assert calls["add_rms_norm"] == 2 * model.config.num_hidden_layers
    assert torch.equal(fused_logp, logp) and torch.equal(fused_entropy, entropy)
    for name, grad in grads.items():
        assert torch.equal(fused_grads[name], grad), name
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_add_rms_norm_backward_sums_both_gradients():
    """add_rms_norm against the add then the norm, forward and backward: the same bits in fp32; in bf16 within a
    rounding (the interpreter truncates the sum to bf16 where torch rounds it, and the weight's gradient sums over
    rows); and with either output's gradient missing."""
    g = torch.Generator().manual_seed(3)
    x, residual = torch.randn(2, 9, 64, generator=g), torch.randn(2, 9, 64, generator=g)
    weight = torch.randn(64, generator=g)
    up = [torch.randn(2, 9, 64, generator=g) for _ in range(2)]

    def reference(x, r, w):
        total = x + r
        return total, fused.rms_norm(total, w, 1e-6)

    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(dtype) for t in (x, residual, weight)]
        upstream = [u.to(dtype) for u in up]
        want, want_grads = _grads(reference, *args, upstream=upstream)
        got, got_grads = _grads(lambda x, r, w: fused.add_rms_norm(x, r, w, 1e-6), *args, upstream=upstream)
        for a, b in zip(got + got_grads, want + want_grads, strict=True):
            if dtype == torch.float32:
                assert torch.equal(a, b)
            else:
                assert (a.float() - b.float()).norm() <= 2**-7 * b.float().norm()
    for used in (0, 1):  # the sum alone, the norm alone
        a = [t.detach().clone().requires_grad_(True) for t in (x, residual, weight)]
        fused.add_rms_norm(*a, 1e-6)[used].mul(up[used]).sum().backward()
        b = [t.detach().clone().requires_grad_(True) for t in (x, residual, weight)]
        reference(*b)[used].mul(up[used]).sum().backward()
        assert torch.equal(a[0].grad, b[0].grad) and torch.equal(a[1].grad, b[1].grad)
        assert (a[2].grad is None) == (b[2].grad is None)


def test_shared_input_projections_sum_the_input_gradient_in_the_gemms():
    """q/k/v (and gate/up) of one input: the outputs and the weights' gradients as nn.Linear's, the input's gradient
    summed in fp32 (one rounding), an unused output's gradient left out; anything not a plain bias-free Linear (a
    bias, a hook) runs as the module itself."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 11, 32, generator=g)
    linears = [torch.nn.Linear(32, n, bias=False) for n in (64, 16, 16)]
    ups = [torch.randn(1, 11, n, generator=g) for n in (64, 16, 16)]

    def run(fn, used=(0, 1, 2)):
        xi = x.clone().requires_grad_(True)
        for m in linears:
            m.weight.grad = None
        outs = fn(xi)
        sum((outs[i] * ups[i]).sum() for i in used).backward()
        return outs, xi.grad, [m.weight.grad for m in linears]

    for used in ((0, 1, 2), (0, 2)):
        want, want_dx, want_dw = run(lambda xi: [m(xi) for m in linears], used)
        got, dx, dw = run(lambda xi: fused.shared_input(xi, *linears), used)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=1e-6)
        for a, b in zip(dw, want_dw, strict=True):
            assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-6, atol=1e-6))
    calls = []
    hook = linears[1].register_forward_hook(lambda *a: calls.append(1))
    fused.shared_input(x, *linears)
    assert calls == [1]  # a hooked projection ran as its module
    hook.remove()
    assert type(fused.shared_input(x, *linears)[0].grad_fn).__name__ == "_SharedInputBackward"
    biased = [torch.nn.Linear(32, 8), linears[0]]
    assert type(fused.shared_input(x, *biased)[1].grad_fn).__name__ != "_SharedInputBackward"
