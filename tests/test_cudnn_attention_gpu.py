"""cuDNN's fused attention for packed training rows (unison.engine.cudnn_attention) on the GPU: outputs and gradients
no further from an fp32 computation than flash's, graphs kept across rows, flash where cuDNN refuses a graph, and no
path between a row's samples."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_qwen3

from unison.engine import cudnn_attention as ca
from unison.engine.attention import varlen_causal
from unison.engine.attention_ops import varlen_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(ca.frontend() is None, reason="needs cuDNN's frontend (pip install 'unison[gpu]')")]


def packed(lengths, heads, kv_heads, width, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, h, width, device="cuda", generator=g).to(dtype).requires_grad_(True)
               for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, cu, torch.randn(tokens, heads, width, device="cuda", generator=g).to(dtype)


def reference(q, k, v, cu, scale):
    """fp32, one segment at a time, every query head over its KV head."""
    out, group = [], q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (t[a:b].float().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        s = qs @ ks.transpose(1, 2) * scale
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        out.append((s.softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(out)


def run(fn, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(q, k, v)
    (out.float() * grad.float()).sum().backward()
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


@pytest.mark.parametrize("heads, kv_heads, width, dtype", [
    (16, 8, 128, torch.bfloat16), (8, 8, 64, torch.bfloat16), (16, 4, 128, torch.float16), (12, 2, 64, torch.float16),
    (4, 1, 32, torch.bfloat16)])
def test_cudnn_is_as_close_to_fp32_as_flash(heads, kv_heads, width, dtype):
    lengths = [1, 577, 64, 1200, 3, 900, 255]
    q, k, v, cu, grad = packed(lengths, heads, kv_heads, width, dtype)
    scale, longest = width ** -0.5, max(lengths)
    built = len(ca._graphs)
    with ca.packed_rows():
        assert ca.runs(q, k, v, None, None, None)
        ours = run(lambda *t: ca.causal(*t, cu, longest, scale), q, k, v, grad)
    assert len(ca._graphs) >= built + 1
    flash = run(lambda *t: varlen_attention(*t, cu, cu, longest, longest, scale), q, k, v, grad)
    exact = run(lambda *t: reference(*t, cu, scale), q.float(), k.float(), v.float(), grad)
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), ours, flash, exact, strict=True):
        err, flash_err = (a - e).abs().mean().item(), (b - e).abs().mean().item()
        assert err <= 1.25 * flash_err + 1e-6, (name, err, flash_err)
        assert (a - e).abs().max().item() <= 2 * (b - e).abs().max().item() + 1e-3, name


def test_rows_of_one_shape_share_graphs_and_varlen_causal_takes_cudnn():
    q, k, v, cu, _ = packed([300, 600, 200], 16, 8, 128, torch.bfloat16)
    with ca.packed_rows():
        varlen_causal(q, k, v, cu, 600, 128 ** -0.5).sum().backward()
        built = len(ca._graphs)
        # The same graphs: 8 sequences of up to 1024, up to 2048 tokens.
        q2, k2, v2, cu2, _ = packed([700, 300, 109], 16, 8, 128, torch.bfloat16, seed=1)
        varlen_causal(q2, k2, v2, cu2, 700, 128 ** -0.5).sum().backward()
    assert len(ca._graphs) == built and built >= 2
    assert q2.grad is not None and q2.grad.abs().max() > 0


def test_a_refused_graph_runs_flash_bit_for_bit(monkeypatch):
    def refuse(key):
        raise RuntimeError("not supported here")

    monkeypatch.setattr(ca, "_build", refuse)
    q, k, v, cu, _ = packed([100, 37], 16, 8, 128, torch.bfloat16)
    scale = 0.123  # a scale no other test builds a graph for
    with ca.packed_rows(), pytest.warns(UserWarning, match="cuDNN attention refused"):
        out = varlen_causal(q, k, v, cu, 100, scale)
    assert torch.equal(out, varlen_attention(q, k, v, cu, cu, 100, 100, scale))
    with ca.packed_rows():
        varlen_causal(q, k, v, cu, 100, scale)  # refused once: no second warning, no second try
    assert any(key[6] == scale for key in ca._refused)


def test_no_path_between_samples_through_cudnn(monkeypatch):
    from unison.train.leak import leaked_segments

    forwards = []
    forward = ca._forward
    monkeypatch.setattr(ca, "_forward", lambda *a: forwards.append(1) or forward(*a))
    model = tiny_qwen3(vocab=512).cuda().bfloat16()
    ids = torch.randint(0, 512, (1, 18), device="cuda")
    cu = torch.tensor([0, 5, 12, 18], dtype=torch.int32, device="cuda")
    with torch.no_grad(), ca.packed_rows():
        for segment in (0, 1, 2):
            assert leaked_segments(model, ids, cu, segment) == []
    assert len(forwards) == 3 * 2 * 2  # cuDNN ran both layers of both forwards
