"""Continuing a finished request (multi-turn): the next turn decodes on the request's own KV, and what it samples
and reports equals a fresh prefill of the whole conversation, also after preemption, KV lending and a weight
update between the turns."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, teacher_forced_logprobs, tiny_llama, tiny_qwen3
from multiturn_helpers import one_thread  # noqa: F401

from unison.engine import Engine, EngineConfig, SamplingParams

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(), n=1)


def _fresh(model, context: list[int], params: SamplingParams):
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, prefix_caching=False))
    return engine.generate([context], params)[0]


def _two_turns(engine, prompts, tool_tokens, params, between=None):
    """Turn 1 of every prompt, ``between(engine)``, then each request extended with its tool tokens."""
    ids = [engine.submit(p, params, continuable=True)[0] for p in prompts]
    first = {c.request_id: c for c in _drain(engine)}
    if between is not None:
        between(engine)
    for rid, tool in zip(ids, tool_tokens, strict=True):
        assert engine.extend(rid, tool) == rid
    second = {c.request_id: c for c in _drain(engine)}
    return [first[r] for r in ids], [second[r] for r in ids]


def _drain(engine):
    done = []
    while engine.num_unfinished:
        done += engine.step()
    return done


def _assert_matches_fresh(model, first, second, tool_tokens, params):
    for c1, c2, tool in zip(first, second, tool_tokens, strict=True):
        context = c1.prompt_ids + c1.token_ids + tool
        assert c2.prompt_ids == context
        ref = _fresh(model, context, params)
        assert c2.token_ids == ref.token_ids
        assert torch.allclose(torch.tensor(c2.logprobs), torch.tensor(ref.logprobs), atol=1e-5, rtol=0)
        # ... and both are the model's own teacher-forced logprobs of those tokens
        tf = teacher_forced_logprobs(model, context, c2.token_ids)
        assert torch.allclose(torch.tensor(c2.logprobs), tf, atol=1e-5, rtol=0)


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3])
def test_continuing_a_request_equals_a_fresh_prefill_of_the_conversation(build):
    model = build()
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4))
    prompts = random_prompts([9, 5])
    tools = random_prompts([3, 7], seed=1)
    first, second = _two_turns(engine, prompts, tools, GREEDY)
    _assert_matches_fresh(model, first, second, tools, GREEDY)
    # The second turn computed only the tool tokens and the last sampled token, not the conversation again.
    assert engine.stats()["tokens_computed"] == sum(len(p) for p in prompts) + 2 * 5 + sum(len(t) + 1 for t in tools) \
        + 2 * 5


def test_a_groups_shared_prompt_blocks_stay_shared_across_turns():
    model = tiny_llama()
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4))
    prompt = random_prompts([10])[0]
    params = SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=(), n=2, seed=3)
    ids = engine.submit(prompt, params, continuable=True)
    _drain(engine)
    parked = engine.scheduler.parked
    shared = parked[ids[0]].blocks[:2]
    assert parked[ids[1]].blocks[:2] == shared  # the two full prompt blocks are one copy
    for rid in ids:
        engine.extend(rid, [7, 8, 9], SamplingParams(max_new_tokens=4, temperature=1.0, stop_token_ids=(), seed=5))
    engine.step()
    for rid in ids:
        assert engine.scheduler.running[[r.request_id for r in engine.scheduler.running].index(rid)].blocks[:2] \
            == shared
    assert all(engine.allocator.refcount[b] == 2 for b in shared)
    _drain(engine)
    assert engine.release(ids) == 2 and engine.allocator.num_free == 64


def test_continuing_survives_preemption_in_a_small_pool():
    model = tiny_qwen3()
    # 10 blocks of 4 tokens for six conversations of ~20 tokens: requests preempt one another and parked KV goes.
    engine = Engine(model, EngineConfig(num_blocks=10, block_size=4, max_batch_tokens=16))
    prompts = random_prompts([9, 6, 11, 7, 8, 5], seed=2)
    tools = random_prompts([4, 6, 3, 5, 2, 7], seed=3)
    first, second = _two_turns(engine, prompts, tools, GREEDY)
    assert engine.stats()["num_preemptions"] > 0
    _assert_matches_fresh(model, first, second, tools, GREEDY)


def test_continuing_after_lending_the_kv_pool_recomputes_the_context():
    model = tiny_llama()
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4))
    prompts, tools = random_prompts([9, 6]), random_prompts([3, 4], seed=1)

    def lend(e):
        with e.lend():
            pass

    first, second = _two_turns(engine, prompts, tools, GREEDY, between=lend)
    _assert_matches_fresh(model, first, second, tools, GREEDY)


def test_a_turn_after_an_in_place_weight_update_sees_the_new_weights():
    model = tiny_llama()
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=4, inflight_policy="recompute"))
    prompts, tools = random_prompts([9, 6]), random_prompts([3, 4], seed=1)

    def update(e):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        e.weights_updated(1)

    first, second = _two_turns(engine, prompts, tools, GREEDY, between=update)
    assert all(c.weight_versions == [0] * len(c.token_ids) for c in first)
    assert all(c.weight_versions == [1] * len(c.token_ids) for c in second)
    _assert_matches_fresh(model, first, second, tools, GREEDY)  # fresh prefills under the new weights


def test_extend_refuses_what_it_cannot_continue():
    engine = Engine(tiny_llama(), EngineConfig(num_blocks=16, block_size=4, max_model_len=24))
    (plain,) = engine.submit([5, 6, 7], GREEDY)
    (rid,) = engine.submit([5, 6, 7], GREEDY, continuable=True)
    with pytest.raises(KeyError, match="not a finished continuable request"):
        engine.extend(rid, [3])  # still running
    _drain(engine)
    with pytest.raises(KeyError, match="continuable=True"):
        engine.extend(plain, [3])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.extend(rid, [10_000])
    with pytest.raises(ValueError, match="no room"):
        engine.extend(rid, list(range(3, 30)))
    engine.extend(rid, [3, 4])  # still parked after the refusals
    assert len(_drain(engine)[0].token_ids) == 6
