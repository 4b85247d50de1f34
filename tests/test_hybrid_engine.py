"""The engine on hybrid models: every conv, gated delta-net and Mamba2 layer keeps a state per request (the state pool)
beside the attention layers' paged KV, so generation is exactly the model's own: greedy equals HF ``generate`` with
the model's own cache, and the sampled logprobs equal a teacher-forced forward through chunked prefill, preemption,
the n-way fork of a group from its prompt's kept state, in-place weight updates, KV lending, multi-turn
continuation and the static decode path of CUDA graphs. (Sequence layers the engine does not know are refused:
tests/test_parity.py.)"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from conftest import max_logprob_diff, random_prompts
from hybrid_models import HYBRIDS, tiny_hybrid
from test_engine import assert_logprobs_across_the_update

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.parity import check_parity

FAMILIES = list(HYBRIDS)
NO_STOP = ()


def make_engine(model, **kw) -> Engine:
    cfg = dict(num_blocks=64, block_size=4, max_batch_tokens=16, seed=0)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def assert_all_freed(engine: Engine) -> None:
    s = engine.scheduler
    assert engine.allocator.num_free == engine.config.num_blocks
    assert sorted(s.free_states) == list(range(engine.config.max_num_seqs))


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate_with_its_own_cache(family):
    model = tiny_hybrid(family)
    own = tiny_hybrid(family, attn="eager")  # the same weights, transformers' own attention and cache
    engine = make_engine(model, max_batch_tokens=8)  # the 21-token prompt takes three chunks
    prompts = random_prompts([3, 21])
    done = engine.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=NO_STOP))
    own.generation_config.eos_token_id = None  # never stop, and never suppress eos either (as the engine here)
    for prompt, c in zip(prompts, done, strict=True):
        ref = own.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=0)
        assert c.token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_through_chunked_prefill_preemption_and_the_fork(family):
    model = tiny_hybrid(family)
    # 14 blocks of 4 tokens: a 10 + 14 token request takes 6 of them, so the groups cannot all run at once.
    engine = make_engine(model, num_blocks=14, max_num_seqs=8)
    prompts = random_prompts([10, 17, 1, 6])
    done = engine.generate(prompts, SamplingParams(max_new_tokens=14, n=2, stop_token_ids=NO_STOP))
    assert [len(c.token_ids) for c in done] == [14] * 8
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_rate"] > 0  # samples forked from their prompt's kept state
    assert max_logprob_diff(model, done) < 1e-4
    assert len({tuple(c.token_ids) for c in done[2:4]}) == 2  # a group's samples really diverge after the fork
    assert_all_freed(engine)


def test_fork_shares_the_prompt_and_its_state():
    model = tiny_hybrid("qwen3_5")
    engine = make_engine(model, max_batch_tokens=64)
    prompt = random_prompts([30])
    done = engine.generate(prompt, SamplingParams(max_new_tokens=4, n=4, stop_token_ids=NO_STOP))
    # The first sample computes the prompt's 7 cacheable blocks (28 tokens) and keeps the state after them; the
    # other three start there, computing 2 prompt tokens each (and every sample its 3 decode tokens).
    stats = engine.stats()
    assert stats["prefix_cache_hit_rate"] == pytest.approx(3 * 28 / (4 * 30))
    assert stats["tokens_computed"] == 30 + 3 * 2 + 4 * 3
    assert max_logprob_diff(model, done) < 1e-4


@pytest.mark.parametrize("family,policy", [("qwen3_next", "keep"), ("lfm2", "keep"), ("falcon_h1", "keep"),
                                           ("qwen3_5", "recompute")])
def test_inflight_requests_across_an_in_place_update(family, policy):
    model = tiny_hybrid(family)
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = make_engine(model, inflight_policy=policy)
    params = SamplingParams(max_new_tokens=12, stop_token_ids=NO_STOP)
    for prompt in random_prompts([7, 12]):
        engine.submit(prompt, params)
    assert not [c for _ in range(5) for c in engine.step()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.weights_updated(engine.version + 1)
    done = [c for _ in range(40) for c in engine.step()]
    assert len(done) == 2
    assert_logprobs_across_the_update(model, old, done, policy)


def test_lending_the_pools_mid_generation_and_continuing_a_turn():
    model = tiny_hybrid("falcon_h1")
    engine = make_engine(model)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=NO_STOP)
    ids = [engine.submit(p, params, continuable=True)[0] for p in random_prompts([9, 4])]
    first = [c for _ in range(3) for c in engine.step()]
    with engine.lend() as lent:
        assert lent == engine.pool.nbytes + engine.states.nbytes  # the state pool is lent with the KV
    while engine.num_unfinished:
        first += engine.step()
    assert max_logprob_diff(model, first) < 1e-4
    tool = random_prompts([3], seed=1)[0]
    for rid in ids:  # the next turn decodes from the parked request's own state and KV
        engine.extend(rid, tool)
    second = []
    while engine.num_unfinished:
        second += engine.step()
    assert all(c.prompt_ids[-3:] == tool for c in second)
    assert max_logprob_diff(model, second) < 1e-4
    assert engine.release(ids) == 2
    assert_all_freed(engine)


@pytest.mark.parametrize("family", ["qwen3_5", "falcon_h1"])
def test_static_decode_path(family):
    """The CUDA-graph runner's static buffers (run eagerly on the CPU, Triton in its interpreter): each row's state
    slot from the static metadata, a one-token prompt starting from zeros."""
    model = tiny_hybrid(family)
    engine = make_engine(model, attention="triton")
    done = engine.generate(random_prompts([5, 1]), SamplingParams(max_new_tokens=5, n=2, stop_token_ids=NO_STOP))
    assert engine.stats()["graph_steps"] > 0
    assert max_logprob_diff(model, done) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_parity_guard_passes_hybrids(family):
    report = check_parity(tiny_hybrid(family))
    assert report.engine_max < 1e-4 and report.trainer_max < 1e-4


def test_unison_train_on_a_hybrid_at_lr_zero(tmp_path, caplog):
    """`unison train` end to end on a saved Qwen3.5: the parity guard and the leak check pass, the memory plan counts
    the state pool (lent with the KV), and engine and trainer agree on every sampled token."""
    from conftest import tiny_tokenizer
    from test_train_e2e import run_cfg, task

    from unison.train.loop import train

    path = tmp_path / "qwen3_5"
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tiny_hybrid("qwen3_5").save_pretrained(path)
    tok.save_pretrained(path)
    out = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="unison")
    train(run_cfg(str(path), out, "--optim.lr=0.0", "--max_steps=2", "--memory.lend_kv=always"), task())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:
        assert r["mismatch/logprob_diff_max"] < 1e-4 and r["is/clipfrac"] == 0
    assert "layer state pool" in caplog.text and "lent with the KV pool" in caplog.text
