"""Multi-head latent attention from the latent cache (``unison.engine.mla``): every MLA family transformers has
(DeepSeek-V2/V3 in ``arch_models``; GLM-4.7-Flash, Youtu and LongCat-Flash here) through the engine against the
same weights on eager attention; the latent and the expanded cache against each other; the memory each takes;
DeepSeek-V3.2's sparse attention refused."""

from __future__ import annotations

import pytest
import torch
import transformers
from arch_models import COMMON, tiny
from conftest import random_prompts, teacher_forced_logprobs

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.engine.cache import kv_widths

MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
           qk_rope_head_dim=8, v_head_dim=12)
MORE_FAMILIES = {
    # Interleaved RoPE, a dense then an MoE layer.
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        MLA, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse"])),
    "youtu": ("YoutuConfig", "YoutuForCausalLM", dict(MLA, intermediate_size=64)),
    # LoRA scalings of the query and the latent; zero experts.
    "longcat_flash": ("LongcatFlashConfig", "LongcatFlashForCausalLM", dict(
        MLA, num_layers=1, head_dim=8, ffn_hidden_size=64, expert_ffn_hidden_size=32, n_routed_experts=4, moe_topk=2,
        zero_expert_num=2)),
}


def tiny_more(family: str):
    config_name, model_name, kw = MORE_FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**COMMON, **kw)
    cls = getattr(transformers, model_name)
    model = cls._from_config(config, attn_implementation="unison", dtype=torch.float32).eval()
    eager = cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    eager.load_state_dict(model.state_dict())
    return model, eager


def _engine(model, **kw) -> Engine:
    cfg = dict(num_blocks=12, block_size=4, max_batch_tokens=16, seed=0, attention="torch")
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


@pytest.mark.parametrize("family", list(MORE_FAMILIES))
def test_more_mla_families_equal_eager_through_chunking_and_preemption(family):
    model, eager = tiny_more(family)
    engine = _engine(model)
    assert engine.pool.has_latent
    done = engine.generate(random_prompts([10, 7, 3, 9, 5, 8], seed=1),
                           SamplingParams(max_new_tokens=20, stop_token_ids=()))
    assert engine.stats()["num_preemptions"] > 0
    diff = max((teacher_forced_logprobs(eager, c.prompt_ids, c.token_ids) - torch.tensor(c.logprobs)).abs().max()
               for c in done)
    assert diff < 1e-4, f"{family}: engine logprobs {diff:.2e} from eager"
    prompt = random_prompts([13], seed=2)[0]
    greedy = _engine(model, num_blocks=64).generate([prompt], SamplingParams(max_new_tokens=12, temperature=0,
                                                                            stop_token_ids=()))[0]
    ref = eager.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                         pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy.token_ids == ref


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_latent_and_expanded_caches_agree_and_the_latent_is_smaller(family):
    model, _ = tiny(family)
    prompts = random_prompts([10, 7, 3, 9], seed=3)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=())
    latent, expanded = _engine(model, num_blocks=40), _engine(model, num_blocks=40, mla_cache="expanded")
    a, b = latent.generate(prompts, params), expanded.generate(prompts, params)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    diff = max((torch.tensor(x.logprobs) - torch.tensor(y.logprobs)).abs().max() for x, y in zip(a, b, strict=True))
    assert diff < 1e-5
    c = model.config
    per_token = {"latent": c.kv_lora_rank + c.qk_rope_head_dim,
                 "expanded": c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim)}
    slots = 41 * 4 * c.num_hidden_layers * 4  # blocks (one scratch) * block size * layers * fp32 bytes
    assert latent.pool.nbytes == slots * per_token["latent"]
    assert expanded.pool.nbytes == slots * per_token["expanded"]


def test_latent_pool_views_share_the_row():
    model, _ = tiny("deepseek_v3")
    (layer, *_) = kv_widths(model.config)
    assert (layer.kv_heads, layer.key_dim, layer.value_dim, layer.value_in_key) == (1, 24, 16, True)
    engine = _engine(model)
    k, v = engine.pool.k[0], engine.pool.v[0]
    assert k.shape[1:] == (1, 24) and v.shape[1:] == (1, 16) and v.data_ptr() == k.data_ptr()
    k[3, 0, :16] = 1.0
    assert (v[3] == 1.0).all() and not engine.pool.k[1].any()


def test_sparse_attention_is_refused():
    config = transformers.DeepseekV32Config(**COMMON, **MLA, intermediate_size=64, moe_intermediate_size=32,
                                            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                            index_topk=8, index_head_dim=16, index_n_heads=2,
                                            first_k_dense_replace=1)
    with pytest.raises(ValueError, match="sparse attention"):
        kv_widths(config)
