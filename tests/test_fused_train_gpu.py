"""The trainer's fused kernels on the GPU, in bf16: each at the bf16 floor of the PyTorch function it replaces (no
further from an fp64 computation than PyTorch's bf16 is), and a bf16 model's packed logprobs and gradients as
close to its fp32 ones with the kernels as without."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3
from test_logprobs import packed_row
from transformers.models.qwen3 import modeling_qwen3

from unison.train.logprobs import chunked_logprobs, policy_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from unison.train import fused  # noqa: E402


def _run(fn, inputs, upstream):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    sum((o.double() * u).sum() for o, u in zip(outs, upstream, strict=True)).backward()
    return [o.detach().double() for o in outs] + [t.grad.double() for t in inputs]


def _floor(fused_fn, torch_fn, inputs, upstream):
    """Mean |error| from an fp64 run of ``torch_fn``: (the kernels', PyTorch's bf16), one per output and gradient."""
    exact = _run(torch_fn, [t.double() for t in inputs], upstream)
    ours = _run(fused_fn, inputs, upstream)
    theirs = _run(torch_fn, inputs, upstream)
    return [((a - e).abs().mean().item(), (b - e).abs().mean().item()) for a, b, e in zip(ours, theirs, exact,
                                                                                              strict=True)]


def _assert_at_floor(gaps, slack=1.1):
    for i, (ours, theirs) in enumerate(gaps):
        print(f"output/grad {i}: kernels {ours:.3e}  pytorch bf16 {theirs:.3e}")
        assert ours <= theirs * slack + 1e-6, (i, ours, theirs)


@pytest.mark.parametrize("rows,width", [(8192, 1024), (8191 * 3, 128)], ids=["hidden", "heads"])
def test_rms_norm_bf16_at_the_floor(rows, width):
    """A hidden state's norm (a row a program) and a q/k norm's (eight rows at a time, a ragged last program)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, width, device="cuda", generator=g).bfloat16() * 3
    w = (1 + 0.1 * torch.randn(width, device="cuda", generator=g)).bfloat16()
    upstream = [torch.randn(rows, width, device="cuda", generator=g, dtype=torch.float64)]
    norm = modeling_qwen3.Qwen3RMSNorm(width).cuda()

    def reference(x, w):
        return torch.func.functional_call(norm, {"weight": w}, (x,))

    _assert_at_floor(_floor(lambda x, w: fused.rms_norm(x, w, 1e-6), reference, [x, w], upstream))


def test_rope_and_silu_mul_bf16_at_the_floor():
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, 4096, 16, 128, device="cuda", generator=g).bfloat16().transpose(1, 2)
    k = torch.randn(1, 4096, 8, 128, device="cuda", generator=g).bfloat16().transpose(1, 2)
    freqs = torch.rand(1, 4096, 64, device="cuda", generator=g) * 100
    cos, sin = (torch.cat([f] * 2, -1).bfloat16() for f in (freqs.cos(), freqs.sin()))
    upstream = [torch.randn(q.shape, device="cuda", generator=g, dtype=torch.float64),
                torch.randn(k.shape, device="cuda", generator=g, dtype=torch.float64)]
    _assert_at_floor(_floor(lambda q, k: fused.rope(q, k, cos, sin),
                            lambda q, k: modeling_qwen3.apply_rotary_pos_emb(q, k, cos.to(q.dtype), sin.to(q.dtype)),
                            [q, k], upstream))
    gate = torch.randn(8192, 3072, device="cuda", generator=g).bfloat16() * 3
    up = torch.randn(8192, 3072, device="cuda", generator=g).bfloat16()
    upstream = [torch.randn(8192, 3072, device="cuda", generator=g, dtype=torch.float64)]
    _assert_at_floor(_floor(fused.silu_mul, lambda a, b: torch.nn.functional.silu(a) * b, [gate, up], upstream))
    assert torch.equal(fused.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)  # transformers' rounding


def test_qk_norm_rope_bf16_at_the_floor():
    """Qwen3-0.6B's heads over 8191 tokens: the q/k norms and RoPE in one kernel (fused_qk) against transformers'
    modules, outputs and the gradients of q, k and both weights; the forward the engine's ``qkv_rope_write`` (the
    same roundings, compiled alike: nearly every bit), so the trainer's logprobs stay the engine's."""
    from unison.engine.fused_layer import qkv_rope_write
    from unison.train.fused_qk import qk_norm_rope

    g = torch.Generator(device="cuda").manual_seed(3)
    tokens, heads, kv_heads, dim = 8191, 16, 8, 128
    q = (torch.randn(tokens, heads, dim, device="cuda", generator=g) * 3).bfloat16()
    k = torch.randn(tokens, kv_heads, dim, device="cuda", generator=g).bfloat16()
    freqs = torch.rand(tokens, dim // 2, device="cuda", generator=g) * 1000
    cos, sin = torch.cat([freqs.cos()] * 2, -1).bfloat16(), torch.cat([freqs.sin()] * 2, -1).bfloat16()
    norms = [modeling_qwen3.Qwen3RMSNorm(dim, eps=1e-6).cuda().bfloat16() for _ in range(2)]
    for norm in norms:
        norm.weight.data = (1 + 0.1 * torch.randn(dim, device="cuda", generator=g)).bfloat16()
    upstream = [torch.randn(t.shape, device="cuda", generator=g, dtype=torch.float64) for t in (q, k)]

    def reference(q, k, wq, wk):
        qn = torch.func.functional_call(norms[0], {"weight": wq}, (q[None],)).transpose(1, 2)
        kn = torch.func.functional_call(norms[1], {"weight": wk}, (k[None],)).transpose(1, 2)
        qr, kr = modeling_qwen3.apply_rotary_pos_emb(qn, kn, cos[None].to(q.dtype), sin[None].to(q.dtype))
        return qr.transpose(1, 2)[0], kr.transpose(1, 2)[0]

    weights = [norms[0].weight, norms[1].weight]
    exact = _run(reference, [t.double() for t in (q, k, *weights)], upstream)
    theirs = _run(reference, [q, k, *weights], upstream)
    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k)]
    outs = qk_norm_rope(*inputs, *norms, cos, sin)
    sum((o.double() * u).sum() for o, u in zip(outs, upstream, strict=True)).backward()
    ours = [o.detach().double() for o in outs] + [t.grad.double() for t in (*inputs, *weights)]
    _assert_at_floor([((a - e).abs().mean().item(), (b - e).abs().mean().item())
                      for a, b, e in zip(ours, theirs, exact, strict=True)])
    k_pool, v_pool = torch.zeros(2, tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    engine_q = qkv_rope_write(q, k, k, cos, sin, k_pool, v_pool, torch.arange(tokens, device="cuda"), *norms)
    same = [(a == b).float().mean().item() for a, b in ((outs[0], engine_q), (outs[1], k_pool))]
    print(f"qk_norm_rope against the engine's qkv_rope_write: same bits q {same[0]:.6f}, k {same[1]:.6f}")
    assert min(same) > 0.999


def test_logprob_kernels_equal_pytorch_on_the_gpu():
    torch.manual_seed(2)
    hidden = torch.randn(3000, 1024, device="cuda").bfloat16().requires_grad_(True)
    weight = (torch.randn(151936, 1024, device="cuda") * 0.05).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 151936, (3000,), device="cuda")
    upstream = torch.randn(3000, device="cuda")
    results = []
    for kernels in (False, True):
        logp, entropy = chunked_logprobs(hidden, weight, targets, 0.9, 1024, with_entropy=True, kernels=kernels)
        (logp * upstream).sum().backward()
        results.append((logp.detach(), entropy, hidden.grad.float(), weight.grad.float()))
        hidden.grad = weight.grad = None
    (logp, entropy, gh, gw), (klogp, kentropy, kgh, kgw) = results
    torch.testing.assert_close(klogp, logp, rtol=0, atol=2e-5)
    torch.testing.assert_close(kentropy, entropy, rtol=0, atol=2e-5)
    for ours, theirs in ((kgh, gh), (kgw, gw)):  # bf16 gradients: a rounding step apart here and there
        assert (ours - theirs).norm() <= 1e-3 * theirs.norm()



def test_chunked_loss_is_the_recompute_on_the_gpu():
    """Qwen3-0.6B's head: the gradient taken in the forward (each token's d loss / d logp inside the backward kernel)
    against logprobs, loss, then the recomputing backward: the logprobs bit for bit, the bf16 gradients within a
    rounding (d logp differs in fp32's last bits, and a bf16 d logit can round the other way)."""
    from unison.train.logprobs import chunked_loss
    from unison.train.loss import LossConfig, grpo_loss, token_loss

    torch.manual_seed(3)
    hidden = torch.randn(3000, 1024, device="cuda").bfloat16().requires_grad_(True)
    weight = (torch.randn(151936, 1024, device="cuda") * 0.05).bfloat16().requires_grad_(True)
    targets = torch.randint(0, 151936, (3000,), device="cuda")
    with torch.no_grad():
        logp, _ = chunked_logprobs(hidden, weight, targets, 0.9, 1024)
    engine, advantages = logp + 0.1 * torch.randn_like(logp), torch.randn_like(logp)
    logp, entropy = chunked_logprobs(hidden, weight, targets, 0.9, 1024, with_entropy=True)
    grpo_loss(logp, engine, advantages, LossConfig(), 3000)[0].backward()
    want = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    share = token_loss(engine, advantages, LossConfig(), 3000)
    loss, fused_logp, fused_entropy = chunked_loss(hidden, weight, targets, share, 0.9, 1024, with_entropy=True)
    loss.backward()
    assert torch.equal(fused_logp, logp.detach()) and torch.equal(fused_entropy, entropy)
    for got, exact in zip((hidden.grad, weight.grad), want, strict=True):
        assert (got.float() - exact.float()).norm() <= 1e-3 * exact.float().norm()
        assert (got.float() - exact.float()).abs().max() <= 2**-7 * exact.float().abs().max()
    assert want[1].abs().max() > 0

@pytest.mark.parametrize("cfg", [dict(type="cispo", eps_high=5.0), dict(type="grpo", is_mode="truncate", beta=0.04)],
                         ids=["cispo", "grpo-truncate-old-ref"])
def test_loss_gradient_in_the_kernel_on_the_gpu(cfg):
    """The d logits kernel's closed-form d loss / d logp (``triton_logprobs._token_grad``) on the GPU, for the losses
    beside dapo: cispo's capped weight, grpo's per-token divisor with later iterations' fixed IS weight, truncation
    and the reference's KL; against the kernels' logprobs, then ``grpo_loss`` and its backward."""
    from unison.train.logprobs import chunked_loss
    from unison.train.loss import LossConfig, grpo_loss, token_loss

    torch.manual_seed(7)
    m, vocab = 2500, 151936
    hidden = torch.randn(m, 1024, device="cuda").bfloat16().requires_grad_(True)
    weight = (torch.randn(vocab, 1024, device="cuda") * 0.05).bfloat16().requires_grad_(True)
    targets = torch.randint(0, vocab, (m,), device="cuda")
    with torch.no_grad():
        logp, _ = chunked_logprobs(hidden, weight, targets, 1.0, 1024)
    loss_cfg = LossConfig(**cfg)
    noise = lambda s: logp + s * torch.randn_like(logp)  # noqa: E731
    engine, advantages = noise(0.3), torch.randn_like(logp)
    args = {} if loss_cfg.type == "cispo" else dict(
        divisor=torch.rand(m, device="cuda") * 400 + 100, old_logprobs=noise(0.2), ref_logprobs=noise(0.1))
    logp = chunked_logprobs(hidden, weight, targets, 1.0, 1024)[0]
    want_loss = grpo_loss(logp, engine, advantages, loss_cfg, m, **args)[0]
    want_loss.backward()
    want = hidden.grad.float(), weight.grad.float()
    hidden.grad = weight.grad = None
    loss, fused_logp, _ = chunked_loss(hidden, weight, targets, token_loss(engine, advantages, loss_cfg, m, **args),
                                       1.0, 1024)
    loss.backward()
    assert torch.equal(fused_logp, logp.detach())
    torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-5, atol=1e-7)
    for got, exact in zip((hidden.grad.float(), weight.grad.float()), want, strict=True):
        assert (got - exact).norm() <= 1e-3 * exact.norm() and exact.abs().max() > 0


@pytest.mark.parametrize("build,joined", [(tiny_qwen3, False), (tiny_qwen3, True), (tiny_llama, True)],
                         ids=["qwen3-apart", "qwen3-joined", "llama-joined"])
def test_bf16_model_with_kernels_at_the_floor(build, joined):
    """A bf16 Qwen3 (q_norm/k_norm, GQA) packed forward and backward, with and without the kernels, against the
    same weights in fp32: the kernels' logprobs and gradients are no further from fp32 than transformers' are; with
    q/k/v and gate/up ``joined`` (``pack_projections``, one GEMM each way) too, and a joined Llama (no q/k norms)."""
    from unison.engine.fused_linear import pack_projections

    ref = build(vocab=2048).cuda()
    model = copy.deepcopy(ref).bfloat16()
    if joined:
        assert pack_projections(model) == 2 * model.config.num_hidden_layers
    row = packed_row(2048).to("cuda")

    def run(m, kernels):
        m.zero_grad(set_to_none=True)
        logp, _ = policy_logprobs(m, row, temperature=1.0, chunk_size=16, kernels=kernels)
        (logp * torch.linspace(-1, 1, logp.shape[0], device="cuda")).sum().backward()
        return logp.detach().double(), {n: p.grad.double() for n, p in m.named_parameters()}

    exact, exact_grads = run(ref, False)
    for name, (logp, grads) in {"kernels": run(model, True), "transformers": run(model, False)}.items():
        gap = (logp - exact).abs().mean().item()
        grad_gap = sum((grads[n] - g).norm().item() / g.norm().item() for n, g in exact_grads.items())
        print(f"{name}: logprob gap {gap:.3e}, relative grad gap (summed) {grad_gap:.3e}")
        if name == "kernels":
            ours = (gap, grad_gap)
        else:
            assert ours[0] <= gap * 1.25 + 1e-4 and ours[1] <= grad_gap * 1.25, (ours, gap, grad_gap)


def test_adamw_kernels_equal_pytorch_on_the_gpu():
    from unison.train.adamw import adamw_step, write_back

    g = torch.Generator(device="cuda").manual_seed(3)
    n = 10_000_019
    master = torch.randn(n, device="cuda", generator=g)
    runs = []
    for kernel in (False, True):
        state = [master.clone(), torch.zeros_like(master), torch.zeros_like(master)]
        param = master.bfloat16()
        for step in range(1, 4):
            grad = torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(step)).bfloat16()
            adamw_step(state[0], grad, state[1], state[2], step=step, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                       weight_decay=0.1, grad_scale=0.7, kernel=kernel)
            changed = write_back(param, state[0], kernel=kernel)
        runs.append((state, param, changed))
    (state, param, changed), (kstate, kparam, kchanged) = runs
    for ours, theirs in zip(kstate, state, strict=True):  # torch's own kernels contract multiply-adds: an ulp or two
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    print(f"adamw: masters bitwise equal {(kstate[0] == state[0]).float().mean():.6f}")
    mismatch = (kparam.view(torch.int16) != param.view(torch.int16)).float().mean().item()
    assert mismatch < 1e-5  # only where the fp32 masters straddle a bf16 rounding boundary
    assert (kchanged != changed).float().mean().item() < 1e-5


def test_one_launch_optimizer_step_equals_a_launch_per_tensor():
    """``DeviceStore``'s one-launch step against its launch-per-tensor path over ten steps of ``MasterAdamW``: the
    bf16 parameters, masters, changed masks and changed fraction the same, an fp32 parameter (outside the launch)
    among them."""
    from test_optimizer import make_params, set_grads

    from unison.train.optimizer import MasterAdamW, OptimConfig
    from unison.train.state_store import DeviceStore

    cfg = OptimConfig(lr=1e-4, weight_decay=0.01, max_grad_norm=1.0)
    runs = []
    for one_launch in (True, False):
        params = {n: torch.nn.Parameter(p.cuda()) for n, p in make_params(torch.bfloat16).items()}
        params["fp32"] = torch.nn.Parameter(torch.randn(33, 17, generator=torch.Generator().manual_seed(1)).cuda())
        opt = MasterAdamW(params.items(), cfg, total_steps=10, store=DeviceStore(fused=one_launch))
        fractions = []
        for step in range(10):
            set_grads(params, step, 1.0)
            fractions.append(opt.step().changed_fraction)
        runs.append((params, opt, fractions))
    (a, fused_opt, fused_fractions), (b, plain_opt, plain_fractions) = runs
    assert fused_opt.store._multi and not plain_opt.store._multi
    assert fused_fractions == plain_fractions and 0 < fused_fractions[-1] < 1
    for name in a:
        assert torch.equal(a[name].view(torch.int16 if a[name].dtype == torch.bfloat16 else torch.int32),
                           b[name].view(torch.int16 if b[name].dtype == torch.bfloat16 else torch.int32)), name
        assert torch.equal(fused_opt.state[name].master, plain_opt.state[name].master), name
        assert torch.equal(fused_opt.changed_masks[name], plain_opt.changed_masks[name]), name
