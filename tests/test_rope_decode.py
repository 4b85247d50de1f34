"""The decode step's q/k norms, RoPE, K/V write and paged attention in one launch (unison.engine.rope_decode) in
Triton's interpreter: the same output and the same pools as the two launches it replaces (``qkv_rope_write``, then
``paged_decode``), bit for bit, on random inputs, with one split a sequence and several; and the backend's choice
of it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

pytest.importorskip("triton")

from unison.engine.fused_layer import qkv_rope_write  # noqa: E402
from unison.engine.rope_decode import rope_paged_decode  # noqa: E402
from unison.engine.triton_attention import paged_decode  # noqa: E402
from unison.engine.triton_backend import TritonPagedBackend, TritonState  # noqa: E402


def _case(heads: int, kv_heads: int, dim: int, block_size: int, contexts: list[int], dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    batch = len(contexts)
    blocks = sum(-(-c // block_size) for c in contexts) + 3
    k_pool = torch.randn(blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    v_pool = torch.randn(blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    order = torch.randperm(blocks, generator=g)
    width = max(-(-c // block_size) for c in contexts)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    used = 0
    for i, c in enumerate(contexts):
        n = -(-c // block_size)
        tables[i, :n] = order[used:used + n].int()
        used += n
    lens = torch.tensor(contexts, dtype=torch.int32)
    last = lens.long() - 1  # the step's token sits at its context's last position
    slots = tables.long()[torch.arange(batch), last // block_size] * block_size + last % block_size
    q = torch.randn(batch, heads, dim, generator=g).to(dtype)
    k = torch.randn(batch, kv_heads, dim, generator=g).to(dtype)
    v = torch.randn(batch, kv_heads, dim, generator=g).to(dtype)
    cos = torch.randn(batch, dim, generator=g).to(dtype)
    sin = torch.randn(batch, dim, generator=g).to(dtype)
    return q, k, v, cos, sin, k_pool, v_pool, slots, tables, lens


def _norms(dim: int, dtype):
    q_norm, k_norm = Qwen3RMSNorm(dim, eps=1e-6), Qwen3RMSNorm(dim, eps=1e-5)
    with torch.no_grad():
        q_norm.weight.uniform_(0.5, 1.5)
        k_norm.weight.uniform_(-1.0, 1.0)
    return q_norm.to(dtype), k_norm.to(dtype)


@pytest.mark.parametrize("heads, kv_heads, dim, norm, window, dtype, splits", [
    (4, 2, 32, True, None, torch.float32, 1),
    (6, 2, 16, False, None, torch.float32, 1),  # a group of three: four rows, one naming no head
    (4, 4, 32, True, 5, torch.float32, 1),
    (4, 2, 32, True, None, torch.bfloat16, 1),
    (4, 2, 32, True, None, torch.float32, 4),  # 16-key shares: the shorter contexts' later splits empty
    (4, 2, 32, False, 9, torch.float32, 3),  # a window split three ways
])
def test_one_launch_equals_the_two(heads, kv_heads, dim, norm, window, dtype, splits):
    q, k, v, cos, sin, k_pool, v_pool, slots, tables, lens = _case(heads, kv_heads, dim, 4, [1, 7, 16, 21, 40], dtype)
    q_norm, k_norm = _norms(dim, dtype) if norm else (None, None)
    kp, vp = k_pool.clone(), v_pool.clone()
    rotated = qkv_rope_write(q, k, v, cos, sin, kp, vp, slots, q_norm, k_norm)
    want = paged_decode(rotated, kp, vp, tables, lens, 4, dim**-0.5, window, splits=splits, block_n=16)
    kf, vf = k_pool.clone(), v_pool.clone()
    got = rope_paged_decode(q, k, v, cos, sin, kf, vf, slots, tables, lens, 4, dim**-0.5, window, q_norm, k_norm,
                            splits, block_n=16)
    assert torch.equal(kf, kp) and torch.equal(vf, vp)  # the new keys and values written, nothing else
    assert not torch.equal(kp, k_pool)
    assert torch.equal(got, want)


def test_the_backend_takes_it_for_decode_only_steps(monkeypatch):
    monkeypatch.delenv("UNISON_ROPE_DECODE", raising=False)
    assert TritonPagedBackend(4, 2, torch.device("cpu")).rope_decode  # on by default
    monkeypatch.setenv("UNISON_ROPE_DECODE", "0")
    assert not TritonPagedBackend(4, 2, torch.device("cpu")).rope_decode  # the benchmarks' A/B
    q, k, v, cos, sin, k_pool, v_pool, slots, tables, lens = _case(4, 2, 32, 4, [5, 9], torch.float32)
    backend = TritonPagedBackend(4, 2, torch.device("cpu"), torch.float32, block_n=16, rope_decode=True)
    args = (k_pool, v_pool, slots, q, k, v, cos, sin, None, None, 32**-0.5, None)
    assert backend.decode_rope(TritonState(None, tables, lens, 1), *args) is not None
    assert backend.decode_rope(TritonState(None, tables, lens, 2), *args) is not None  # split contexts too
    mixed = TritonState(None, tables, lens, 1)
    mixed.decode_rows = torch.tensor([0, 3])
    assert backend.decode_rope(mixed, *args) is None  # decode rows among a prefill's: two launches
    backend.rope_decode = False
    assert backend.decode_rope(TritonState(None, tables, lens, 1), *args) is None  # turned off: two launches


class _Launches:
    """A Triton kernel whose launches' keyword arguments are kept."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch


def test_the_one_launch_normalises_in_the_two_launches_tile(monkeypatch):
    """Each head's sum of squares is reduced in an order that the program's tile and warps decide (on a GPU; the
    interpreter has one order), so the one launch normalises the GQA group's rows in ``qkv_rope_write``'s tile (8
    rows, 4 warps at 128-wide heads) and is not taken where its rows or warps cannot be that tile's. (With 4 rows
    against 8, on an H100, one key element in ~10^6 rounded otherwise and the engine's logprobs parted.)"""
    from unison.engine import fused_layer, rope_decode

    one = _Launches(rope_decode._rope_decode_kernel)
    two = _Launches(fused_layer._qkv_rope_write_kernel)
    monkeypatch.setattr(rope_decode, "_rope_decode_kernel", one)
    monkeypatch.setattr(fused_layer, "_qkv_rope_write_kernel", two)
    q, k, v, cos, sin, k_pool, v_pool, slots, tables, lens = _case(16, 8, 128, 16, [3, 20], torch.float32)
    q_norm, k_norm = _norms(128, torch.float32)
    qkv_rope_write(q, k, v, cos, sin, k_pool.clone(), v_pool.clone(), slots, q_norm, k_norm)
    rope_paged_decode(q, k, v, cos, sin, k_pool, v_pool, slots, tables, lens, 16, 128**-0.5, None, q_norm, k_norm)
    assert (one.seen[0]["ROWS"], one.seen[0]["num_warps"]) == (two.seen[0]["HEADS"], two.seen[0]["num_warps"]) == (8, 4)
    monkeypatch.setattr(rope_decode, "_INTERPRET", False)
    assert rope_decode.equals_two_launches(16, 8, 128, num_warps=4)  # Qwen3-0.6B/1.7B: a group of 2 in 8 rows
    assert rope_decode.equals_two_launches(32, 8, 128, num_warps=4)  # a group of 4
    assert not rope_decode.equals_two_launches(64, 8, 128, num_warps=4)  # a group of 8 and its key: 9 rows
    assert not rope_decode.equals_two_launches(32, 8, 64, num_warps=4)  # 64-wide heads: qkv_rope_write's one warp
    backend = TritonPagedBackend(16, 8, torch.device("cpu"), torch.float32, rope_decode=True)
    args = (k_pool, v_pool, slots, q, k, v, cos, sin, q_norm, k_norm, 128**-0.5, None)
    assert backend.decode_rope(TritonState(None, tables, lens, 1), *args) is not None
    backend.kernel_args["num_warps"] = 8  # another tile's warps: two launches
    assert backend.decode_rope(TritonState(None, tables, lens, 1), *args) is None


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("heads, kv_heads", [(16, 8), (32, 8), (8, 8)])
def test_one_launch_equals_the_two_on_gpu(heads, kv_heads, norm, splits):
    """At the engine's shapes on a GPU (bf16, 128-wide heads, 16-slot blocks), eager and replayed in a CUDA graph
    (programmatic launch on Hopper): bit for bit the two launches' output and pools."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    contexts = [1, 2, 15, 16, 17, 63, 64, 65, 200, 352, 577, 1000] * 6
    case = _case(heads, kv_heads, 128, 16, contexts, torch.bfloat16, seed=heads + norm)
    q, k, v, cos, sin, k_pool, v_pool, slots, tables, lens = (x.cuda() for x in case)
    q_norm, k_norm = (m.cuda() for m in _norms(128, torch.bfloat16)) if norm else (None, None)
    kp, vp = k_pool.clone(), v_pool.clone()
    rotated = qkv_rope_write(q, k, v, cos, sin, kp, vp, slots, q_norm, k_norm)
    want = paged_decode(rotated, kp, vp, tables, lens, 16, 128**-0.5, splits=splits)
    kf, vf = k_pool.clone(), v_pool.clone()
    got = rope_paged_decode(q, k, v, cos, sin, kf, vf, slots, tables, lens, 16, 128**-0.5, None, q_norm, k_norm,
                            splits)
    assert torch.equal(kf, kp) and torch.equal(vf, vp)
    assert torch.equal(got, want)
    kg, vg = k_pool.clone(), v_pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = rope_paged_decode(q, k, v, cos, sin, kg, vg, slots, tables, lens, 16, 128**-0.5, None, q_norm,
                                     k_norm, splits)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, want) and torch.equal(kg, kp) and torch.equal(vg, vp)


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
def test_one_launch_equals_the_two_on_packed_projections(norm):
    """As the engine calls it: q, k and v views of one packed q|k|v projection output (row stride 32 heads), 64
    sequences of 60-163 keys (a GRPO rollout's decode), twelve draws: bit for bit the two launches' output and pools.
    (It failed on an H100 while the one launch normalised in 4 rows against ``qkv_rope_write``'s 8, as the engine's
    logprobs did: bench/results/h100/speed/rope2/README.md.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for seed in range(12):
        contexts = torch.randint(60, 164, (64,), generator=torch.Generator().manual_seed(seed)).tolist()
        case = _case(16, 8, 128, 16, contexts, torch.bfloat16, seed=seed)
        q, k, v, cos, sin, k_pool, v_pool, slots, tables, lens = (x.cuda() for x in case)
        qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)
        q, k, v = (qkv[:, a:b].view(64, -1, 128) for a, b in ((0, 2048), (2048, 3072), (3072, 4096)))
        q_norm, k_norm = (m.cuda() for m in _norms(128, torch.bfloat16)) if norm else (None, None)
        kp, vp = k_pool.clone(), v_pool.clone()
        rotated = qkv_rope_write(q, k, v, cos, sin, kp, vp, slots, q_norm, k_norm)
        want = paged_decode(rotated, kp, vp, tables, lens, 16, 128**-0.5)
        kf, vf = k_pool.clone(), v_pool.clone()
        got = rope_paged_decode(q, k, v, cos, sin, kf, vf, slots, tables, lens, 16, 128**-0.5, None, q_norm, k_norm)
        assert torch.equal(kf, kp) and torch.equal(vf, vp), seed
        assert torch.equal(got, want), seed
