"""The decode step's fused projections (unison.engine.fused_linear) in Triton's interpreter, against PyTorch's
linear layers on random inputs: q/k/v in one launch, gate/up with SwiGLU in another, and the module swap."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import count_calls, max_logprob_diff, random_prompts, tiny_llama, tiny_qwen3

pytest.importorskip("triton")

from unison.engine import Engine, EngineConfig, SamplingParams, fused_linear, triton_linear  # noqa: E402
from unison.engine.fused_linear import fused_projections  # noqa: E402
from unison.engine.fused_norm import add_rms_norm  # noqa: E402
from unison.engine.triton_linear import gated, linear, project  # noqa: E402


@pytest.mark.parametrize("rows", [1, 5, 16, 37])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("loads", ["tma", "pointer"])
def test_project_equals_three_linears(rows, bias, loads):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    weights = [torch.randn(n, 96, generator=g) / 10 for n in (64, 40, 24)]  # widths not multiples of the tile
    biases = [torch.randn(n, generator=g) for n in (64, 40, 24)] if bias else None
    outs = project(x, weights, biases, loads=loads)
    for i, (out, w) in enumerate(zip(outs, weights, strict=True)):
        ref = F.linear(x, w, biases[i] if bias else None)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(linear(x, w, biases[i] if bias else None, loads=loads), ref, atol=1e-5, rtol=1e-5)


def test_loads_through_descriptors_only_where_every_row_is_aligned():
    """Tensor descriptors need 16-byte aligned rows (fp32 in the interpreter, whose 16-bit descriptor loads are
    wrong): a row of 94 floats or a base 8 bytes off takes the pointer kernels, and computes the same."""
    x = torch.randn(6, 100)
    w = torch.randn(40, 96)
    assert triton_linear.loads_for(x[:, :96], [w], 40) == "tma"
    assert triton_linear.loads_for(x.bfloat16()[:, :96], [w.bfloat16()], 40) == "pointer"
    odd = [x[:, 2:96], x.view(-1)[2:2 + 6 * 96].view(6, 96)]  # rows 94 wide (376 bytes); a base 8 bytes off
    assert [triton_linear.loads_for(o, [w[:, :o.shape[1]]], 40) for o in odd] == ["pointer", "pointer"]
    torch.testing.assert_close(linear(odd[1], w), F.linear(odd[1], w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [3, 20])
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("loads", ["tma", "pointer"])
def test_split_linear_sums_the_shares_of_k(rows, splits, loads):
    """K in shares side by side, each tile's partials summed by its last program: x @ w.T + b, the same bits on a
    second launch (the tiles' counters are back at 0), and an output of a partial last tile."""
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, 256), torch.randn(80, 256), torch.randn(80)
    first = triton_linear.split_linear(x, w, b, splits, loads=loads)
    torch.testing.assert_close(first, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    assert torch.equal(triton_linear.split_linear(x, w, b, splits, loads=loads), first)
    assert not triton_linear._counters[x.device].any()
    with pytest.raises(ValueError, match="whole"):
        triton_linear.split_linear(x[:, :200], w[:, :200], None, splits)


@pytest.mark.parametrize("rows", [3, 20])
@pytest.mark.parametrize("splits", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_split_parts_summed_in_the_norm_kernel_are_split_linears_bits(rows, splits, bias):
    """The shares left unsummed (``split_parts``) and summed by the residual add + norm kernel: the sum and the
    normalised sum bit for bit those of ``split_linear``'s output added there; a partial last column tile; partials
    of another shape refused."""
    torch.manual_seed(rows + splits)
    x, w, b = torch.randn(rows, 512), torch.randn(80, 512), torch.randn(80)
    residual, norm_w = torch.randn(rows, 80), torch.randn(80)
    summed = triton_linear.split_linear(x, w, b if bias else None, splits)
    parts = triton_linear.split_parts(x, w, b if bias else None, splits)
    assert parts.shape == (rows, 80) and parts.parts.shape[0] == splits
    torch.testing.assert_close(parts.parts[:, :rows].sum(0), F.linear(x, w), atol=1e-4, rtol=1e-4)  # no bias yet
    expected = add_rms_norm(summed, residual, norm_w, 1e-6)
    got = add_rms_norm(parts, residual, norm_w, 1e-6)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    torch.testing.assert_close(got[0], residual + F.linear(x, w, b if bias else None), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="partials"):
        add_rms_norm(parts, residual[:-1], norm_w, 1e-6)


def test_split_for_fills_one_wave_with_whole_k_steps():
    """0.6B's o_proj (1024 x 2048) and down_proj (1024 x 3072) at 64 rows: 32 column tiles, four shares each on
    132 multiprocessors; 1.7B's o_proj (2048 wide, 64 tiles) two; a K of one step none."""
    assert fused_linear.split_for(64, 1024, 2048, 2, 132) == 4
    assert fused_linear.split_for(64, 1024, 3072, 2, 132) == 4
    assert fused_linear.split_for(64, 2048, 2048, 2, 132) == 2
    assert fused_linear.split_for(16, 1024, 128, 2, 132) == 1


def test_programmatic_launch_prefetches_whole_aligned_pieces(monkeypatch):
    """Off the GPU (and with UNISON_PDL=0) the kernels launch one after another. A programmatic launch prefetches a
    weight row's first bytes (PREFETCH_BYTES in all at most) in one piece a thread where the pieces are whole 16-byte
    units at aligned addresses, else nothing."""
    from unison.engine import gdc

    assert gdc.launch(torch.zeros(1)) == {"PDL": False}
    w = torch.zeros(64, 1024, dtype=torch.bfloat16)
    assert triton_linear._prefetch_parts([w, w], block_n=32, warps=4) == (4, 512)
    assert triton_linear._prefetch_parts([w[:, :1000]], block_n=32, warps=4) == (4, 496)  # 1984 of 2000 bytes
    odd = torch.zeros(64, 1001, dtype=torch.bfloat16)
    assert triton_linear._prefetch_parts([odd], block_n=32, warps=4) == (0, 0)  # rows 2002 bytes apart
    big = torch.zeros(6144, 2048, dtype=torch.bfloat16, device="meta")  # 1.7B's gate and up: 16 MiB in all
    assert triton_linear._prefetch_parts([big, big], block_n=32, warps=4) == (4, 336)
    down = torch.zeros(2048, 6144, dtype=torch.bfloat16, device="meta")  # 1.7B's down_proj in two shares of K
    assert triton_linear._prefetch_parts([down], block_n=32, warps=4, shares=2) == (4, 1024)
    assert triton_linear._prefetch_parts([w.view(-1)[4:4 + 32 * 1024].view(32, 1024)], 32, 4) == (0, 0)  # 8 bytes off
    monkeypatch.setenv("UNISON_PDL", "0")
    assert not gdc.enabled(torch.zeros(1))


def test_more_rows_than_one_wave_holds_take_cublas():
    """Up to 64 rows the kernels take any width; above, only a width whose column tiles fit one wave of programs
    (132 multiprocessors: 0.6B's 3072-wide gate/up in 96 tiles yes, 1.7B's 6144-wide in 192 no); past MAX_ROWS
    none."""
    takes = fused_linear.takes
    assert takes(64, 6144, 32, 132) and takes(256, 3072, 32, 132) and takes(256, 4096, 32, 132)
    assert not takes(65, 6144, 32, 132) and not takes(256, 4225, 32, 132)
    assert not takes(fused_linear.MAX_ROWS + 1, 64, 32, 132)


@pytest.mark.parametrize("rows", [3, 20])
@pytest.mark.parametrize("loads", ["tma", "pointer"])
def test_gated_equals_swiglu(rows, loads):
    """fp32 here: Triton's interpreter truncates fp32 to bf16 where the GPU rounds to nearest, so the bf16 roundings
    are tested on the GPU (tests/test_triton_gpu.py)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 160, generator=g)  # K = 160: a partial last K step
    gate, up = (torch.randn(72, 160, generator=g).div(8) for _ in range(2))
    torch.testing.assert_close(gated(x, gate, up, loads=loads), F.silu(F.linear(x, gate)) * F.linear(x, up), atol=1e-5,
                               rtol=1e-5)


@pytest.fixture
def on_cpu(monkeypatch):
    """The swapped-in forwards run the kernels on the CPU too (in the interpreter; the engine's default is the GPU)."""
    monkeypatch.setattr(fused_linear, "DEVICES", {"cpu", "cuda"})


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3])
def test_fused_projections_swap_and_restore(make, on_cpu, monkeypatch):
    """Every layer's attention and MLP switched inside the block: the model's output as before; outside it the
    modules' own forward again; more rows than the kernels take fall through to PyTorch's (MAX_ROWS set low); the
    output projections keep PyTorch's (no single-weight kernel is swapped in)."""
    model = make()
    ids = torch.randint(3, 256, (1, 9))
    with torch.no_grad():
        ref = model(ids).logits
        calls = count_calls(monkeypatch, fused_linear, ["project", "gated"])
        single = count_calls(monkeypatch, triton_linear, ["linear"])
        with fused_projections(model) as switched:
            out = model(ids).logits
            assert switched == 2 * model.config.num_hidden_layers
            monkeypatch.setattr(fused_linear, "MAX_ROWS", 4)
            model(ids)  # 9 rows > 4: PyTorch's projections
        assert calls == {"project": 2, "gated": 2} and single == {"linear": 0}  # the first forward, once per layer
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        layer = model.model.layers[0]
        for module in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp, layer.mlp.down_proj):
            assert "forward" not in module.__dict__


class _Subclass(torch.Tensor):  # a tensor subclass (as a DTensor or a quantised weight is one)
    pass


def test_only_plain_linear_layers_are_swapped(on_cpu):
    """The kernels read a weight's storage as a plain row-major matrix: a tensor-subclass weight, a transposed
    (non-contiguous) one, a dtype or input width unlike the others', a bias on some only, or a subclass of
    ``nn.Linear`` keeps the module's own forward."""
    def group(**change):
        layers = [torch.nn.Linear(32, n, bias=False) for n in (32, 16, 16)]
        for name, value in change.items():
            index, attr = name.split("_", 1)
            layer = layers[int(index[1:])]
            if not isinstance(value, torch.nn.Parameter):
                delattr(layer, attr)  # a plain tensor in the parameter's place
            setattr(layer, attr, value)
        return layers

    assert fused_linear._plain(group())
    assert fused_linear._plain(group(l1_weight=torch.randn(16, 32)))  # a plain tensor, not a Parameter
    refused = [group(l1_weight=torch.nn.Parameter(torch.randn(16, 32).as_subclass(_Subclass))),
               group(l2_weight=torch.nn.Parameter(torch.randn(32, 16).t())),
               group(l0_weight=torch.nn.Parameter(torch.randn(32, 32, dtype=torch.float64))),
               group(l2_weight=torch.nn.Parameter(torch.randn(16, 48))),
               group(l1_bias=torch.nn.Parameter(torch.zeros(16)))]
    refused.append([torch.nn.Linear(32, 32, bias=False), type("Sub", (torch.nn.Linear,), {})(32, 16, bias=False)])
    assert not any(fused_linear._plain(layers) for layers in refused)
    model = tiny_llama()
    attn = model.model.layers[0].self_attn
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().as_subclass(_Subclass))
    with fused_projections(model) as switched:
        assert switched == 2 * model.config.num_hidden_layers - 1  # that attention keeps its own projections
        assert "forward" not in attn.q_proj.__dict__ and "forward" in model.model.layers[1].self_attn.q_proj.__dict__


@pytest.mark.parametrize("joined", [False, True], ids=["apart", "joined"])
def test_engine_decodes_through_the_fused_projections(joined, on_cpu, monkeypatch):
    """The decode runner's graphs (eager here) run both kernels: the engine's logprobs stay teacher-forced ones, with
    the weights apart or laid out as one matrix a group (``pack_projections``, as ``load_policy`` loads them)."""
    calls = count_calls(monkeypatch, fused_linear, ["project", "gated"])
    model = tiny_qwen3()
    if joined:
        assert fused_linear.pack_projections(model) == 2 * model.config.num_hidden_layers
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, seed=0, attention="triton", max_num_seqs=4))
    done = engine.generate(random_prompts([5, 9]), SamplingParams(max_new_tokens=6, stop_token_ids=()))
    assert engine.stats()["graph_steps"] >= 4
    assert calls["project"] >= 4 * model.config.num_hidden_layers and calls["gated"] == calls["project"]
    assert max_logprob_diff(model, done) < 1e-4
