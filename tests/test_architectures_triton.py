"""The fast engine path (the Triton decode kernel in Triton's interpreter, the mixed-step backend, the decode
runner) for the families with sinks, MLA widths and softcapping, against eager attention."""

from __future__ import annotations

import pytest
import torch
from arch_models import tiny
from conftest import random_prompts, teacher_forced_logprobs

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.engine.backend import StepLayout, TorchPagedBackend

pytest.importorskip("triton")

from unison.engine.triton_backend import TritonPagedBackend  # noqa: E402


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "gemma2"])
def test_triton_engine_logprobs_equal_eager(family):
    """Chunked prefill and preemption (10 blocks of 4 for 3 requests of up to 22 tokens), decode-only steps
    through the runner at padded batch sizes."""
    model, eager = tiny(family)
    engine = Engine(model, EngineConfig(num_blocks=10, block_size=4, max_batch_tokens=8, seed=0,
                                        attention="triton", max_num_seqs=4))
    done = engine.generate(random_prompts([9, 4, 6], seed=6), SamplingParams(max_new_tokens=12, stop_token_ids=()))
    stats = engine.stats()
    assert stats["graph_steps"] > 0 and stats["num_preemptions"] > 0
    diff = max((teacher_forced_logprobs(eager, c.prompt_ids, c.token_ids) - torch.tensor(c.logprobs)).abs().max()
               for c in done)
    assert diff < 1e-4, f"{family}: {diff:.2e}"


@pytest.mark.parametrize("k_dim,v_dim,sinks,softcap", [(24, 12, True, None), (16, 16, False, 1.5)])
def test_mixed_step_backend_equals_reference(k_dim, v_dim, sinks, softcap):
    """Decode rows (the kernel) and multi-token chunks in one step, sinks, softcapping and MLA widths."""
    g = torch.Generator().manual_seed(7)
    block_size, heads, kv_heads = 4, 4, 2
    k_pool = torch.randn(40 * block_size, kv_heads, k_dim, generator=g)
    v_pool = torch.randn(40 * block_size, kv_heads, v_dim, generator=g)
    q_lens, ctx = [1, 6, 1, 3], [9, 6, 17, 11]
    tables = [torch.randperm(40, generator=g)[:6].tolist() for _ in ctx]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    q = 2 * torch.randn(starts[-1], heads, k_dim, generator=g)
    sink = 2 * torch.randn(heads, generator=g) if sinks else None
    layout = StepLayout(starts, ctx, tables, torch.zeros(starts[-1], dtype=torch.int64))
    outs = []
    for backend in (TorchPagedBackend(block_size, "cpu"), TritonPagedBackend(block_size, kv_heads, "cpu",
                                                                             torch.float32)):
        outs.append(backend.attend(backend.prepare(layout), k_pool, v_pool, q, k_dim**-0.5, 5, sinks=sink,
                                   softcap=softcap))
    assert outs[0].shape == (starts[-1], heads, v_dim)
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_latent_decode_kernel_equals_reference(splits):
    """The latent-cache kernel (one [c, k_rot] row per token for all heads, c also the value): 20 heads (two head
    blocks, the second partial), a rope part narrower than a block, split contexts; against the reference."""
    from unison.engine.triton_mla import mla_decode

    g = torch.Generator().manual_seed(8)
    block_size, heads, rank, rope = 4, 20, 32, 8
    kv = torch.randn(40 * block_size, 1, rank + rope, generator=g)
    ctx = [9, 1, 17, 30]
    tables = [torch.randperm(40, generator=g)[:8].tolist() for _ in ctx]
    q = torch.randn(len(ctx), heads, rank + rope, generator=g)
    layout = StepLayout(list(range(len(ctx) + 1)), ctx, tables, torch.zeros(len(ctx), dtype=torch.int64))
    torch_backend = TorchPagedBackend(block_size, "cpu")
    ref = torch_backend.attend(torch_backend.prepare(layout), kv, kv[..., :rank], q, 0.3, None)
    out = mla_decode(q, kv, rank, torch.tensor(tables, dtype=torch.int32), torch.tensor(ctx, dtype=torch.int32),
                     block_size, 0.3, splits=splits)
    assert out.shape == (len(ctx), heads, rank)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
