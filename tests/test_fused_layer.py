"""The engine's fused decoder layers (unison.engine.fused_layer) in Triton's interpreter, against transformers' own
modules on random inputs: the residual add in the norm's kernel, q/k norms with RoPE and the K/V write in one, which
classes they take, and the engine decoding through them. fp32 here: the interpreter truncates fp32 to bf16 where
the GPU rounds to nearest, so the bf16 roundings are tested on the GPU (tests/test_triton_gpu.py)."""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import count_calls, max_logprob_diff, random_prompts, tiny_llama, tiny_qwen3
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

pytest.importorskip("triton")

from unison.engine import Engine, EngineConfig, SamplingParams, fused_layer, fused_linear, triton_backend  # noqa: E402
from unison.engine.fused_layer import attention_form, fused_layers, llama_layer, qkv_rope_write  # noqa: E402
from unison.engine.fused_norm import add_rms_norm, llama_norm  # noqa: E402


def _modeling(family: str):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


@pytest.fixture
def on_cpu(monkeypatch):
    """The swapped-in forwards run the kernels on the CPU too (in the interpreter; the engine's default is the GPU)."""
    monkeypatch.setattr(fused_layer, "DEVICES", {"cpu", "cuda"})


@pytest.mark.parametrize("rows", [1, 7])
def test_add_rms_norm_is_the_add_then_the_norm(rows):
    g = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(2, rows, 96, generator=g)  # 96: a partial block of columns
    norm = _modeling("qwen3").Qwen3RMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96, generator=g)
    total, normed = add_rms_norm(x, residual, norm.weight, norm.variance_epsilon)
    assert torch.equal(total, residual + x)
    torch.testing.assert_close(normed, norm(residual + x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 32), (6, 1, 24), (16, 8, 64)])
def test_qkv_rope_write_equals_transformers(qk_norm, heads, kv_heads, dim):
    """q/k normalised per head and rotated as Qwen3's attention does, k and v written at their slots and nowhere
    else (the pool poisoned with NaN), q returned."""
    g = torch.Generator().manual_seed(heads * dim + qk_norm)
    n, slots_total = 5, 40
    q = torch.randn(n, heads, dim, generator=g)
    k, v = torch.randn(2, n, kv_heads, dim, generator=g)
    pos = torch.randint(0, 100, (n,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    qwen3 = _modeling("qwen3")
    q_norm, k_norm = qwen3.Qwen3RMSNorm(dim, eps=1e-6), qwen3.Qwen3RMSNorm(dim, eps=1e-5)
    q_norm.weight.data, k_norm.weight.data = torch.randn(2, dim, generator=g)
    k_pool = torch.full((slots_total, kv_heads, dim), float("nan"))
    v_pool = torch.full((slots_total, kv_heads, dim), float("nan"))
    slots = torch.randperm(slots_total, generator=g)[:n]
    out = qkv_rope_write(q, k, v, cos, sin, k_pool, v_pool, slots, q_norm if qk_norm else None,
                         k_norm if qk_norm else None, heads_per_program=4)
    qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]  # (1, H, N, D): transformers' layout
    if qk_norm:
        qh, kh = q_norm(qh), k_norm(kh)
    ref_q, ref_k = qwen3.apply_rotary_pos_emb(qh, kh, cos[None], sin[None])
    torch.testing.assert_close(out, ref_q[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_pool[slots], ref_k[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    assert torch.equal(v_pool[slots], v)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert k_pool[untouched].isnan().all() and v_pool[untouched].isnan().all()


def test_the_classes_each_form_takes():
    """Each family's attention form read from its forward; decoder layers and norms by their statements: MoE and
    MLA layers are Llama's layer too, GptOss's norm rounds elsewhere and Gemma3's layer has four norms."""
    forms = {("llama", "LlamaAttention"): (False, None), ("qwen2", "Qwen2Attention"): (False, "layer"),
             ("qwen3", "Qwen3Attention"): (True, "layer"), ("mistral", "MistralAttention"): (False, "config"),
             ("qwen3_moe", "Qwen3MoeAttention"): (True, "layer"), ("gpt_oss", "GptOssAttention"): None,
             ("glm4_moe", "Glm4MoeAttention"): None}
    for (family, name), form in forms.items():
        assert attention_form(getattr(_modeling(family), name)) == form, name
    for family, name in [("llama", "Llama"), ("qwen3", "Qwen3"), ("qwen3_moe", "Qwen3Moe"),
                         ("deepseek_v3", "DeepseekV3"), ("glm4_moe", "Glm4Moe"), ("mistral", "Mistral")]:
        assert llama_layer(getattr(_modeling(family), f"{name}DecoderLayer")), name
        assert llama_norm(getattr(_modeling(family), f"{name}RMSNorm")), name
    assert not llama_layer(_modeling("gemma3").Gemma3DecoderLayer)
    assert not llama_layer(_modeling("olmo2").Olmo2DecoderLayer)
    assert not llama_norm(_modeling("gpt_oss").GptOssRMSNorm)
    assert not llama_norm(_modeling("gemma3").Gemma3RMSNorm)


def _tiny(family: str):
    model = _tiny_model(family)
    with torch.no_grad():  # norms that are not all ones, so a norm applied with the wrong weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.5)
    return model


def _tiny_model(family: str):
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    if family == "qwen2":  # biased q/k/v, a window on the last layer (shorter than the prompts below)
        cfg = Qwen2Config(**common, use_sliding_window=True, sliding_window=6, max_window_layers=2)
        return Qwen2ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32).eval()
    if family == "mistral":
        cfg = MistralConfig(**common, sliding_window=7)
        return MistralForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32).eval()
    return {"llama": tiny_llama, "qwen3": tiny_qwen3}[family]()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral"])
def test_engine_decodes_through_the_fused_layers(family, on_cpu, monkeypatch):
    """Chunked prefill (4 tokens a step), decode through the runner (eager here), prefix sharing in a group: every
    attention through the fused write (the decode-only steps' in the attention's launch), every layer through the
    fused adds, logprobs teacher-forced ones; the windowed layers keep their window. The modules' own forwards again
    after the engine's forwards, all the steps' swaps planned once."""
    calls = count_calls(monkeypatch, fused_layer, ["qkv_rope_write", "add_rms_norm"])
    fused = count_calls(monkeypatch, triton_backend, ["rope_paged_decode"])
    model = _tiny(family)
    layers = model.config.num_hidden_layers
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, seed=0, attention="triton", max_num_seqs=8,
                                        max_batch_tokens=12))
    engine._fused = engine.runner.swaps  # the prefill steps too, as on the GPU
    engine.backend.rope_decode = True  # (its decode steps split each context in two)
    prompts = random_prompts([9, 13])
    done = engine.generate(prompts + [prompts[0]] * 2, SamplingParams(max_new_tokens=6, stop_token_ids=()))
    steps = engine.stats()["steps"]
    assert engine.stats()["graph_steps"] >= 4
    # the decode-only steps write and attend in one launch, the others in two
    assert fused["rope_paged_decode"] >= 4 * layers
    assert calls["qkv_rope_write"] + fused["rope_paged_decode"] == steps * layers
    assert calls["add_rms_norm"] == 2 * steps * layers  # after attention, after the MLP (the last into the final norm)
    assert max_logprob_diff(model, done) < 1e-4
    assert engine.runner.swaps.plans == 1  # every step's swaps as planned on the first (unison.engine.swaps)
    for module in (model.model.layers[0], model.model.layers[0].self_attn, model.model.norm):
        assert "forward" not in module.__dict__


def test_output_projections_leave_their_shares_to_the_norm_after_them(on_cpu, monkeypatch):
    """o_proj and down_proj with K wide enough to split (256 and 512): at decode's rows each one's split kernel
    leaves its shares unsummed for the residual add + norm after it (the last layer's down_proj for the final
    norm's); the engine's tokens and logprobs are bit for bit those of the shares summed in the split kernel, and
    teacher-forced ones."""
    monkeypatch.setattr(fused_linear, "DEVICES", {"cpu", "cuda"})
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32).eval()
    calls = count_calls(monkeypatch, fused_linear, ["split_parts", "split_linear"])

    def generate():
        engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, seed=0, attention="triton", max_num_seqs=4))
        return engine.generate(random_prompts([5, 9]), SamplingParams(max_new_tokens=5, stop_token_ids=()))

    deferred = generate()
    deferrals = calls["split_parts"]
    assert deferrals > 0 and deferrals % (2 * cfg.num_hidden_layers) == 0 and calls["split_linear"] == 0
    assert max_logprob_diff(model, deferred) < 1e-4
    monkeypatch.setattr(fused_layer, "partials", lambda module, *a, **kw: module(*a, **kw))
    summed = generate()
    assert calls == {"split_parts": deferrals, "split_linear": deferrals}
    for a, b in zip(deferred, summed, strict=True):
        assert a.token_ids == b.token_ids and torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def test_a_tensor_the_layer_did_not_return_gets_its_own_norm(on_cpu):
    """The final norm takes the normalised sum only for the very tensor the last layer returned: given another (a
    vision model's addition in between, say) it normalises that one."""
    model = tiny_qwen3()
    decoder = model.model
    x = torch.randn(1, 3, 64)
    rope = decoder.rotary_emb(x, torch.arange(3)[None])
    with torch.no_grad(), fused_layers(decoder) as switched:
        assert switched == 2 * len(decoder.layers)
        out = decoder.layers[-1](x, attention_mask=None, position_embeddings=rope)
        other = out + 1.0
        torch.testing.assert_close(decoder.norm(other), decoder.norm.__class__.forward(decoder.norm, other))
        out = decoder.layers[-1](x, attention_mask=None, position_embeddings=rope)
        torch.testing.assert_close(decoder.norm(out), decoder.norm.__class__.forward(decoder.norm, out))


def test_nothing_switches_off_the_devices():
    model = tiny_qwen3()
    with fused_layers(model.model) as switched:
        assert switched == 0


def test_a_body_is_its_statements():
    """Docstrings (one line, or closing on a text line), comments and blank lines are not statements."""
    from unison.engine.source import body

    def f(x):
        """One line."""
        y = x + 1  # a comment
        # another

        return y

    def g(x):
        """Several
        lines, closing here."""
        return x

    assert body(f) == ("y = x + 1", "return y")
    assert body(g) == ("return x",)
