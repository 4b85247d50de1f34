"""The Triton decode kernel and the fast backend on a CUDA GPU, against the pure-PyTorch reference on fresh
random inputs (run on the GPU machine: ``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch
from test_triton_engine import reference_decode

from unison.engine.backend import StepLayout, TorchPagedBackend
from unison.engine.fused_norm import rms_norm
from unison.engine.fused_rope import rope
from unison.engine.triton_attention import paged_decode
from unison.engine.triton_backend import TritonPagedBackend
from unison.engine.triton_sampler import FusedSampler

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kernel_on_gpu(group, head_dim, dtype, splits):
    kv_heads, block_size, blocks, batch = 2, 16, 512, 9
    g = torch.Generator("cuda").manual_seed(group * 1000 + head_dim + splits)
    k_pool = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g, device="cuda").to(dtype)
    v_pool = torch.randn(blocks * block_size, kv_heads, head_dim, generator=g, device="cuda").to(dtype)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=g, device="cuda").to(dtype)
    tables = torch.stack([torch.randperm(blocks, generator=g, device="cuda")[:64] for _ in range(batch)]).int()
    # One key, odd lengths, exact block multiples and one past them, a long context.
    context = torch.tensor([1, 3, 15, 16, 17, 63, 64 * 16, 257, 1000], dtype=torch.int32, device="cuda")
    for window in (None, 100):
        out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
        paged_decode(q, k_pool, v_pool, tables, context, block_size, head_dim**-0.5, window, splits=splits, out=out)
        ref = reference_decode(q.cpu(), k_pool.cpu(), v_pool.cpu(), tables.cpu(), context.cpu(), block_size,
                               head_dim**-0.5, window)
        assert torch.isfinite(out).all()
        rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
        assert rel < 5e-3, f"relative error {rel:.2e}"


def mixed_step(heads: int, k_dim: int) -> tuple[torch.Tensor, StepLayout]:
    """One engine step's queries and layout: decode rows, a chunk whose context is longer than it (chunked prefill,
    a prefix hit) and whole prompts, over random block tables of a 256-block pool."""
    q_lens, ctx = [1, 37, 1, 16, 100], [50, 37, 301, 80, 130]
    tables = [torch.randperm(256)[:20].tolist() for _ in ctx]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, k_dim, device="cuda", dtype=torch.bfloat16)
    return q, StepLayout(starts, ctx, tables, torch.zeros(starts[-1], dtype=torch.int64, device="cuda"))


def test_chunks_through_varlen_match_reference():
    """Multi-token chunks whose context is longer than the chunk (chunked prefill, prefix hits), mixed with
    decode rows in one step: the fast backend equals the reference backend."""
    torch.manual_seed(0)
    block_size, heads, kv_heads, dim = 16, 8, 2, 64
    k_pool = torch.randn(256 * block_size, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn_like(k_pool)
    q, layout = mixed_step(heads, dim)
    outs = []
    for backend in (TorchPagedBackend(block_size, "cuda"),
                    TritonPagedBackend(block_size, kv_heads, "cuda", torch.bfloat16)):
        outs.append(backend.attend(backend.prepare(layout), k_pool, v_pool, q, dim**-0.5, None).float())
    rel = ((outs[0] - outs[1]).norm() / outs[0].norm()).item()
    assert rel < 1e-2, f"relative difference {rel:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("width", [128, 1024, 2560, 4096])
def test_fused_rms_norm_on_gpu(width, dtype):
    """Same function as transformers' RMSNorm: fp32 statistics, rounded to the input dtype, times the weight.
    rsqrt approximations differ by an fp32 ulp or two, which can move each of the two roundings by one step."""
    x = torch.randn(300, width, device="cuda").to(dtype)
    w = (torch.rand(width, device="cuda") + 0.5).to(dtype)
    h = x.float()
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out = rms_norm(x, w, 1e-6)
    ulp = 2.0 ** (-7 if dtype == torch.bfloat16 else -10)
    err = (out.float() - ref.float()).abs()
    print(f"rms_norm {dtype} width {width}: max |err| / |ref| {(err / ref.float().abs()).max():.2e}, "
          f"bitwise equal {(out == ref).float().mean():.4f}")
    assert (err <= ref.float().abs() * 2 * ulp + 1e-6).all()
    assert (out == ref).float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_rope_on_gpu_matches_transformers(head_dim, dtype):
    """The kernel rounds where transformers rounds (each product, then the sum), to nearest like PyTorch: within
    one rounding step of the result's terms, and printed, how many elements have the same bits."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, rotate_half

    q = torch.randn(1, 300, 16, head_dim, device="cuda").to(dtype).transpose(1, 2)
    k = torch.randn(1, 300, 8, head_dim, device="cuda").to(dtype).transpose(1, 2)
    angle = torch.rand(1, 300, head_dim // 2, device="cuda") * 1000
    angle = torch.cat([angle, angle], -1)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    out_q, out_k = rope(q, k, cos, sin)
    ulp = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float32: 2.0**-23}[dtype]
    for out, ref, x in ((out_q, ref_q, q), (out_k, ref_k, k)):
        err = (out.float() - ref.float()).abs()
        terms = x.float().abs() + rotate_half(x).float().abs()
        print(f"rope {dtype} head_dim {head_dim}: bitwise equal {(out == ref).float().mean():.5f}, "
              f"max |err| / terms {(err / terms.clamp_min(1e-30)).max():.2e}")
        assert out.stride() == ref.stride()
        assert (err <= ulp * terms).all()


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_fused_sampler_parts_on_gpu(rows):
    """A 152k vocabulary split into parts (as many as fill the GPU) draws what one program per row draws."""
    logits = 4 * torch.randn(rows, 151936, device="cuda")
    temps = [0.0 if i % 5 == 0 else 0.6 + i % 3 * 0.4 for i in range(rows)]
    seeds = list(range(100, 100 + rows))
    t1, l1 = FusedSampler(logits.device, target_programs=1)(logits, temps, seeds)
    t2, l2 = FusedSampler(logits.device)(logits, temps, seeds)
    assert torch.equal(t1, t2)
    torch.testing.assert_close(l1, l2, atol=2e-5, rtol=0)
    ref = torch.log_softmax(logits / torch.tensor([t or 1.0 for t in temps], device="cuda")[:, None], -1)
    torch.testing.assert_close(l2, ref.gather(1, t2[:, None]).squeeze(1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("shape", ["gpt_oss", "mla", "gemma2"])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kernel_sinks_mla_softcap_on_gpu(shape, splits):
    """GptOss (64 heads over 8, sinks, window 128), DeepSeek-V3's MLA widths (keys 192, values 128, one query head
    per KV head, sinks added to exercise the widths with them) and Gemma2 (head dim 256, softcap 50) at bf16."""
    heads, kv_heads, k_dim, v_dim, window, softcap, sinks = {
        "gpt_oss": (64, 8, 64, 64, 128, None, True), "mla": (16, 16, 192, 128, None, None, True),
        "gemma2": (8, 4, 256, 256, None, 50.0, False)}[shape]
    block_size, blocks, batch = 16, 256, 7
    g = torch.Generator("cuda").manual_seed(11 + splits)
    k_pool = torch.randn(blocks * block_size, kv_heads, k_dim, generator=g, device="cuda").bfloat16()
    v_pool = torch.randn(blocks * block_size, kv_heads, v_dim, generator=g, device="cuda").bfloat16()
    q = (3 * torch.randn(batch, heads, k_dim, generator=g, device="cuda")).bfloat16()
    sink = (2 * torch.randn(heads, generator=g, device="cuda")).bfloat16() if sinks else None
    tables = torch.stack([torch.randperm(blocks, generator=g, device="cuda")[:64] for _ in range(batch)]).int()
    context = torch.tensor([1, 15, 16, 17, 257, 700, 1000], dtype=torch.int32, device="cuda")
    out = torch.full((batch, heads, v_dim), float("nan"), device="cuda", dtype=torch.bfloat16)
    paged_decode(q, k_pool, v_pool, tables, context, block_size, k_dim**-0.5, window, splits=splits, out=out,
                 sinks=sink, softcap=softcap)
    ref = reference_decode(q.cpu(), k_pool.cpu(), v_pool.cpu(), tables.cpu(), context.cpu(), block_size,
                           k_dim**-0.5, window, None if sink is None else sink.cpu(), softcap)
    rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    print(f"decode {shape} splits {splits}: relative error {rel:.2e}")
    assert torch.isfinite(out).all() and rel < 5e-3


def _floor_gap(fast, ref32, plain16):
    """max |fast - ref32| and max |plain16 - ref32|: the bf16 floor is what plain bf16 math loses."""
    return (fast.float() - ref32).abs().max().item(), (plain16.float() - ref32).abs().max().item()


@pytest.mark.parametrize("k_dim,v_dim,window", [(64, 64, None), (64, 64, 32), (192, 128, None)])
def test_packed_varlen_with_sinks_at_the_bf16_floor(k_dim, v_dim, window):
    """Flash varlen with the sink correction (forward and the custom backward, GQA 4/2 or MLA widths) against
    the fp32 eager math, next to the same eager math at bf16."""
    from unison.engine.attention import varlen_causal

    torch.manual_seed(0)
    lengths = [100, 1, 257, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t, heads, kv_heads = sum(lengths), 4, (2 if k_dim == v_dim else 4)
    base = [torch.randn(t, heads, k_dim, device="cuda"), torch.randn(t, kv_heads, k_dim, device="cuda"),
            torch.randn(t, kv_heads, v_dim, device="cuda"), 2 * torch.randn(heads, device="cuda")]
    probe = torch.randn(t, heads, v_dim, device="cuda")

    def run(dtype, fast):
        leaves = [x.detach().clone().to(dtype).requires_grad_() for x in base]
        q, k, v, sinks = leaves
        if fast:
            out = varlen_causal(q, k, v, cu, max(lengths), k_dim**-0.5, window, sinks=sinks)
        else:  # the per-segment eager math (what the CPU runs)
            out = torch.cat([causal_attention_ref(q[a:b], k[a:b], v[a:b], k_dim**-0.5, window, sinks)
                             for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)])
        (out.float() * probe).sum().backward()
        return out, [x.grad for x in leaves]

    ref, ref_grads = run(torch.float32, False)
    fast, fast_grads = run(torch.bfloat16, True)
    plain, plain_grads = run(torch.bfloat16, False)
    for name, a, r, p in [("out", fast, ref, plain)] + [
            (n, a, r, p) for n, a, r, p in zip("qkvs", fast_grads, ref_grads, plain_grads, strict=True)]:
        gap, floor = _floor_gap(a, r, p)
        print(f"varlen sinks {k_dim}/{v_dim} window {window} {name}: flash {gap:.3e}, bf16 eager {floor:.3e}")
        assert gap <= 2 * floor + 1e-3, name


@pytest.mark.parametrize("heads,kv_heads,k_dim,v_dim,window", [(16, 8, 128, 128, None), (16, 8, 128, 128, 32),
                                                               (4, 4, 192, 128, None)])
def test_packed_varlen_is_torch_varlen_attn_bit_for_bit(heads, kv_heads, k_dim, v_dim, window):
    """unison's differentiable flash call (``attention_ops._Flash``) gives torch's ``varlen_attn`` bits: output and
    the gradients of k and v (dq: within flash's own run-to-run spread), GQA, a sliding window and MLA widths
    (padded to one width) included."""
    from unison.engine.attention_ops import VARLEN_GQA_KW, _pad_last, torch_varlen_attn, varlen_attention

    if torch_varlen_attn is None:
        pytest.fail("this torch has no torch.nn.attention.varlen to compare with")
    torch.manual_seed(2)
    lengths = [100, 1, 257, 64, 576]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    t = sum(lengths)
    base = [torch.randn(t, heads, k_dim, device="cuda"), torch.randn(t, kv_heads, k_dim, device="cuda"),
            torch.randn(t, kv_heads, v_dim, device="cuda")]
    probe = torch.randn(t, heads, v_dim, device="cuda", dtype=torch.bfloat16)
    window_size = (-1, 0) if window is None else (window - 1, 0)

    def run(ours):
        leaves = [x.detach().clone().bfloat16().requires_grad_() for x in base]
        q, k, v = leaves
        if ours:
            out = varlen_attention(q, k, v, cu, cu, max(lengths), max(lengths), k_dim**-0.5, window)
        else:
            width = max(k_dim, v_dim)
            out = torch_varlen_attn(*(_pad_last(x, width) for x in (q, k, v)), cu, cu, max(lengths), max(lengths),
                                    scale=k_dim**-0.5, window_size=window_size, **VARLEN_GQA_KW)[..., :v_dim]
        (out * probe).sum().backward()
        return [out] + [x.grad for x in leaves]

    ours, torch_a, torch_b = run(True), run(False), run(False)
    for name, a, b in zip(["out", "dk", "dv"], [ours[0], *ours[2:]], [torch_a[0], *torch_a[2:]], strict=True):
        assert torch.equal(a, b), name
    # Flash's backward adds each key block's share of dq with fp32 atomics, in whatever order they land: torch's
    # own path differs from itself run to run by about a bf16 step. So dq is held to that, not to its bits.
    gap, own = ((x.float() - torch_a[1].float()).abs().max().item() for x in (ours[1], torch_b[1]))
    scale = torch_a[1].float().abs().max().item()
    print(f"varlen {heads}/{kv_heads} {k_dim}/{v_dim} window {window}: dq against torch's {gap:.2e}, torch's "
          f"against itself {own:.2e}, |dq| up to {scale:.2e}")
    assert gap <= max(2 * own, 2**-7 * scale)


def causal_attention_ref(q, k, v, scale, window, sinks):
    from unison.engine.attention import causal_attention

    return causal_attention(q, k, v, scale, window, sinks=sinks)


def test_chunks_with_sinks_and_mla_widths_match_reference():
    """Multi-token chunks through flash varlen with sinks and keys 192 / values 128 wide, mixed with decode rows:
    the fast backend equals the reference backend."""
    torch.manual_seed(1)
    block_size, heads, kv_heads, k_dim, v_dim = 16, 8, 8, 192, 128
    k_pool = torch.randn(256 * block_size, kv_heads, k_dim, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.randn(256 * block_size, kv_heads, v_dim, device="cuda", dtype=torch.bfloat16)
    sinks = 2 * torch.randn(heads, device="cuda", dtype=torch.bfloat16)
    q, layout = mixed_step(heads, k_dim)
    outs = []
    for backend in (TorchPagedBackend(block_size, "cuda"),
                    TritonPagedBackend(block_size, kv_heads, "cuda", torch.bfloat16)):
        state = backend.prepare(layout)
        outs.append(backend.attend(state, k_pool, v_pool, q, k_dim**-0.5, None, sinks=sinks).float())
    assert state.chunk_rows is not None  # the chunks really went through varlen
    rel = ((outs[0] - outs[1]).norm() / outs[0].norm()).item()
    print(f"chunks sinks MLA widths: relative difference {rel:.2e}")
    assert outs[1].shape == (q.shape[0], heads, v_dim) and rel < 1e-2


@pytest.mark.parametrize("rows", [1, 7, 64, 128, 256])  # up to fused_linear's row limits
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("loads", ["tma", "pointer"])
def test_fused_projections_on_gpu_at_the_bf16_floor(rows, bias, loads):
    """bf16 q/k/v in one launch, each alone, and gate/up with SwiGLU in another, at the 0.6B shape, through tensor
    descriptors and through pointer loads: each within cuBLAS's own distance of the fp64 result (the summation order
    differs, not the roundings)."""
    from functools import partial

    from unison.engine import triton_linear
    gated, linear, project = (partial(f, loads=loads) for f in (triton_linear.gated, triton_linear.linear,
                                                                triton_linear.project))
    g = torch.Generator("cuda").manual_seed(rows + bias)
    h, widths = 1024, (2048, 1024, 1024)
    x = torch.randn(rows, h, generator=g, device="cuda").bfloat16()
    ws = [(torch.randn(n, h, generator=g, device="cuda") / 32).bfloat16() for n in widths]
    bs = [torch.randn(n, generator=g, device="cuda").bfloat16() for n in widths] if bias else None
    singles = [linear(x, w, bs[i] if bias else None) for i, w in enumerate(ws)]
    for i, out in enumerate([*project(x, ws, bs), *singles]):
        i %= 3
        exact = torch.nn.functional.linear(x.double(), ws[i].double(), bs[i].double() if bias else None)
        ours = (out.double() - exact).abs()
        cublas = (torch.nn.functional.linear(x, ws[i], bs[i] if bias else None).double() - exact).abs()
        # Each rounds the fp32 sum once: at most a rounding step more at a boundary, the same on average.
        assert ours.max() <= 2 * cublas.max() and ours.mean() <= 1.1 * cublas.mean(), (i, ours.max(), cublas.max())
    gate, up = ws[1], ws[2]
    ref = torch.nn.functional.silu(torch.nn.functional.linear(x, gate)) * torch.nn.functional.linear(x, up)
    out = gated(x, gate, up)
    close = (out.float() - ref.float()).abs() <= 2 * 2**-8 * ref.float().abs() + 1e-3  # two bf16 ulps
    assert close.float().mean() > 0.999, close.float().mean()
    assert (out.float() - ref.float()).abs().mean() < 0.02 * ref.float().abs().mean()


@pytest.mark.parametrize("rows", [1, 7, 64])  # up to fused_linear.SPLIT_ROWS
@pytest.mark.parametrize("loads", ["tma", "pointer"])
def test_split_linear_on_gpu_at_the_bf16_floor(rows, loads):
    """bf16 o_proj and down_proj of the 0.6B shape with K in shares (fused_linear.split_for's), each tile's shares
    summed by its last program: within cuBLAS's own distance of the fp64 result, the same bits launch after launch
    (the tiles' counters back at 0), and in a CUDA graph replayed ten times."""
    from unison.engine import fused_linear, triton_linear
    g = torch.Generator("cuda").manual_seed(rows)
    for n, k, bias in ((1024, 2048, False), (1024, 3072, True)):
        splits = fused_linear.split_for(rows, n, k, 2, torch.cuda.get_device_properties(0).multi_processor_count)
        assert splits == 4
        x = torch.randn(rows, k, generator=g, device="cuda").bfloat16()
        w = (torch.randn(n, k, generator=g, device="cuda") / 32).bfloat16()
        b = torch.randn(n, generator=g, device="cuda").bfloat16() if bias else None
        out = triton_linear.split_linear(x, w, b, splits, loads=loads)
        exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        ours = (out.double() - exact).abs()
        cublas = (torch.nn.functional.linear(x, w, b).double() - exact).abs()
        assert ours.max() <= 2 * cublas.max() and ours.mean() <= 1.1 * cublas.mean(), (n, ours.max(), cublas.max())
        for _ in range(3):
            assert torch.equal(triton_linear.split_linear(x, w, b, splits, loads=loads), out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = triton_linear.split_linear(x, w, b, splits, loads=loads)
        for _ in range(10):
            replayed.zero_()
            graph.replay()
            assert torch.equal(replayed, out)
    assert not triton_linear._counters[x.device].any()


def test_batch_sizes_and_contexts_reuse_the_compiled_kernels():
    """The decode kernel at any block-table width, batch or context of a split count it ran before, and the sampler's
    combine kernel at any batch size, run the kernels compiled already (a variant per width or batch size made a
    run's second rollout recompile, ~0.4 s a kernel). The sampler's part kernel has one variant per power-of-two
    tile count (a constant: faster than a run-time loop)."""
    import triton

    compiled = []

    def hook(*args, **kwargs):
        compiled.append(getattr(kwargs.get("fn"), "name", "?"))
        return False

    sampler, kv_heads, bs = FusedSampler(torch.device("cuda")), 8, 16
    k = torch.randn(64 * 40 * bs, kv_heads, 128, device="cuda", dtype=torch.bfloat16)

    def decode(batch, context, splits, width):
        q = torch.randn(batch, 16, 128, device="cuda", dtype=torch.bfloat16)
        tables = torch.randperm(k.shape[0] // bs, device="cuda")[:batch * width].view(batch, width).int()
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        return paged_decode(q, k, k, tables, lens, bs, 0.1, splits=splits)

    for splits in (1, 4, 8):
        decode(64, 300, splits, 19)
    sampler(torch.randn(64, 151936, device="cuda"), [1.0] * 64, list(range(64)))
    previous, triton.knobs.runtime.jit_cache_hook = triton.knobs.runtime.jit_cache_hook, hook
    try:
        for rows in (1, 7, 15, 33, 300):
            sampler(torch.randn(rows, 151936, device="cuda"), [1.0] * rows, list(range(rows)))
        for batch, context, splits, width in ((8, 600, 8, 38), (3, 250, 4, 16), (64, 100, 1, 7), (1, 640, 8, 40),
                                              (17, 33, 1, 3)):
            decode(batch, context, splits, width)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert set(compiled) <= {"_sample_part_kernel"}, compiled


def test_fused_sampler_fast_log_draws_the_softmax_on_gpu():
    """The Gumbel noise through the one-instruction log2 (the GPU's default): 20000 draws, one seed each, of a
    five-token distribution at its softmax frequencies (within 4 standard errors), and the exact logs' draws for
    all but a few seeds."""
    n = 20000
    row = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5] + [-30.0] * 200, device="cuda").repeat(n, 1)
    draws = [FusedSampler(row.device, max_rows=n, fast_log=fast)(row, [1.0] * n, list(range(n)))[0]
             for fast in (True, False)]
    freq = torch.bincount(draws[0], minlength=row.shape[1]).double() / n
    p = row[0].double().softmax(-1)
    assert ((freq - p).abs()[:5] <= 4 * (p * (1 - p) / n).sqrt()[:5]).all(), (freq[:5], p[:5])
    assert (draws[0] != draws[1]).double().mean() < 1e-3
