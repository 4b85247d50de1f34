"""Engine correctness on CPU: logprobs, greedy parity, shared weights, prefix cache, preemption, updates."""

from __future__ import annotations

import pytest
import torch
from conftest import max_logprob_diff, random_prompts, teacher_forced_logprobs, tiny_llama
from transformers import DynamicCache

from unison.engine import Engine, EngineConfig, SamplingParams

NO_STOP = ()


def make_engine(model, **kw) -> Engine:
    cfg = dict(num_blocks=128, block_size=4, max_batch_tokens=64, seed=0)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced(model, temperature):
    engine = make_engine(model)
    prompts = random_prompts([5, 11, 17, 2])
    done = engine.generate(prompts, SamplingParams(max_new_tokens=24, temperature=temperature, n=3,
                                                   stop_token_ids=NO_STOP))
    assert len(done) == 12 and all(len(c.token_ids) == 24 for c in done)
    assert max_logprob_diff(model, done, temperature=temperature) < 1e-4
    # Different samples of one prompt differ: the sampler really samples.
    assert len({tuple(c.token_ids) for c in done[:3]}) > 1


@pytest.mark.parametrize("top_k,top_p", [(20, 1.0), (0, 0.8), (30, 0.7)])
def test_logprobs_renormalised_over_kept_set(model, top_k, top_p):
    engine = make_engine(model)
    params = SamplingParams(max_new_tokens=16, temperature=0.9, top_k=top_k, top_p=top_p, n=2,
                            stop_token_ids=NO_STOP)
    done = engine.generate(random_prompts([6, 13]), params)
    assert max_logprob_diff(model, done, temperature=0.9, top_k=top_k, top_p=top_p) < 1e-4
    # The renormalised logprob is larger than the full-vocabulary one wherever the cut removed mass.
    full = torch.cat([teacher_forced_logprobs(model, c.prompt_ids, c.token_ids, temperature=0.9) for c in done])
    ours = torch.cat([torch.tensor(c.logprobs) for c in done])
    assert (ours >= full - 1e-5).all() and (ours > full + 1e-3).any()


def test_greedy_equals_hf_generate(model):
    engine = make_engine(model, max_batch_tokens=16)  # forces chunked prefill of the longer prompts
    prompts = random_prompts([3, 21, 40])
    done = engine.generate(prompts, SamplingParams(max_new_tokens=30, temperature=0, stop_token_ids=NO_STOP))
    for prompt, c in zip(prompts, done, strict=True):
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=30, min_new_tokens=30,
                             pad_token_id=0)
        assert c.token_ids == ref[0, len(prompt):].tolist()


def test_decodes_from_the_live_parameters():
    model = tiny_llama()
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    engine = make_engine(model)
    prompt = random_prompts([9])
    params = SamplingParams(max_new_tokens=12, stop_token_ids=NO_STOP, seed=3)
    before = engine.generate(prompt, params)[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss = model(torch.tensor(prompt)).logits.logsumexp(-1).mean()
    loss.backward()
    opt.step()
    engine.weights_updated(engine.version + 1)
    after = engine.generate(prompt, params)[0]
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs  # no copy anywhere
    assert max_logprob_diff(model, [after]) < 1e-4
    # The step really moved the distribution: the old logprobs no longer match.
    assert (teacher_forced_logprobs(model, before.prompt_ids, before.token_ids)
            - torch.tensor(before.logprobs)).abs().max() > 1e-2
    assert after.weight_versions == [1] * 12 and before.weight_versions == [0] * 12


def test_prefix_cache_shared_within_group_and_never_stale():
    model = tiny_llama()
    engine = make_engine(model, block_size=4)
    prompt = random_prompts([30])
    params = SamplingParams(max_new_tokens=4, n=4, stop_token_ids=NO_STOP)
    first = engine.generate(prompt, params)
    stats = engine.stats()
    # Three of the four samples are forks of the first: admitted beside it, they share its prompt's 7 full blocks
    # (28 tokens), get its last 2 tokens' KV copied into a block of their own and sample their first token from its
    # logits, so no prompt token is computed twice (before forks, each recomputed those 2 tokens a step later).
    assert stats["prefix_cache_hit_rate"] == pytest.approx(3 * 28 / (4 * 30))
    assert stats["tokens_computed"] == 30 + 4 * 3
    assert max_logprob_diff(model, first) < 1e-4  # every sample, forks included, against a teacher-forced forward
    assert len({tuple(c.token_ids) for c in first}) > 1
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    engine.weights_updated(engine.version + 1)
    done = engine.generate(prompt, SamplingParams(max_new_tokens=6, n=2, stop_token_ids=NO_STOP))
    assert max_logprob_diff(model, done) < 1e-4


def test_forks_of_a_step_that_never_completed_are_queued_again():
    """A group admitted together forks its samples from the first one's prompt; if that step's forward never ran
    (it raised), the next schedule puts the forks back in the queue with their blocks freed, and the group still
    completes exactly."""
    model = tiny_llama()
    engine = make_engine(model, block_size=4)
    free = engine.allocator.num_free
    engine.submit(random_prompts([10])[0], SamplingParams(max_new_tokens=5, n=3, stop_token_ids=NO_STOP, seed=1))
    engine.scheduler.schedule()  # as if this step's forward had failed
    assert len(engine.scheduler.forks) == 2 and engine.allocator.num_free == free - 3 - 2
    done = []
    for _ in range(20):
        done += engine.step()
    assert sorted(len(c.token_ids) for c in done) == [5, 5, 5] and engine.allocator.num_free == free
    assert not engine.scheduler.forks
    assert max_logprob_diff(model, done) < 1e-4


def test_preemption_completes_everything_correctly(model):
    # 12 blocks of 4 tokens: one request of 10 + 30 tokens needs 10 of them; 6 requests cannot run at once.
    engine = make_engine(model, num_blocks=12, block_size=4, max_batch_tokens=32)
    prompts = random_prompts([10, 7, 3, 9, 5, 8])
    done = engine.generate(prompts, SamplingParams(max_new_tokens=30, stop_token_ids=NO_STOP))
    assert [len(c.token_ids) for c in done] == [30] * 6
    assert engine.stats()["num_preemptions"] > 0
    assert engine.stats()["num_free_blocks"] == 12
    assert max_logprob_diff(model, done) < 1e-4


def _run_until_half(engine, prompts, params, steps=6):
    ids = [rid for p in prompts for rid in engine.submit(p, params)]
    finished = []
    for _ in range(steps):
        finished += engine.step()
    return ids, finished


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_inflight_requests_across_an_update(policy):
    model = tiny_llama()
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = make_engine(model, inflight_policy=policy)
    prompts = random_prompts([7, 12])
    params = SamplingParams(max_new_tokens=14, stop_token_ids=NO_STOP)
    _, finished = _run_until_half(engine, prompts, params)
    assert not finished
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.weights_updated(engine.version + 1)
    done = engine.generate([], params) + [c for _ in range(40) for c in engine.step()]
    assert len(done) == 2
    assert_logprobs_across_the_update(model, old, done, policy)


def assert_logprobs_across_the_update(model, old: dict, done, policy: str) -> None:
    """Completions sampled across one in-place update from ``old`` to the model's current weights: the tokens of
    version 0 score as the old weights do, the later ones as the new weights do (``recompute``), or with the old
    weights' KV of the earlier tokens (``keep``, through the model's own cache)."""
    new = {n: p.detach().clone() for n, p in model.named_parameters()}
    for c in done:
        k = c.weight_versions.count(0)
        assert 0 < k < len(c.token_ids) and c.weight_versions == [0] * k + [1] * (len(c.token_ids) - k)
        model.load_state_dict(old)
        ref_old = teacher_forced_logprobs(model, c.prompt_ids, c.token_ids)[:k]
        if policy == "recompute":
            model.load_state_dict(new)
            ref_new = teacher_forced_logprobs(model, c.prompt_ids, c.token_ids)[k:]
        else:
            ref_new = _keep_reference(model, old, new, c.prompt_ids, c.token_ids, k)
        ref = torch.cat([ref_old, ref_new])
        assert (ref - torch.tensor(c.logprobs)).abs().max() < 1e-4
    model.load_state_dict(new)


@torch.no_grad()
def _keep_reference(model, old, new, prompt, tokens, k):
    """KV of prompt + tokens[:k-1] from the old weights, the rest computed with the new ones."""
    model.load_state_dict(old)
    cache = DynamicCache(config=model.config)
    prefix = list(prompt) + list(tokens[:k - 1])
    model(torch.tensor([prefix]), cache=cache, use_cache=True)
    model.load_state_dict(new)
    logits = model(torch.tensor([list(tokens[k - 1:])]), cache=cache, use_cache=True).logits[0, :-1]
    logp = torch.log_softmax(logits.float(), -1)
    return logp.gather(1, torch.tensor(tokens[k:])[:, None]).squeeze(1)


def test_stop_ids_length_and_context():
    model = tiny_llama(max_pos=40)
    engine = make_engine(model)
    prompt = random_prompts([8])[0]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=NO_STOP))[0]
    stop_at = free.token_ids[4]
    stopped = engine.generate([prompt], SamplingParams(max_new_tokens=12, temperature=0,
                                                       stop_token_ids=[250, stop_at]))[0]
    first = free.token_ids.index(stop_at)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    ctx = engine.generate([prompt], SamplingParams(max_new_tokens=100, stop_token_ids=NO_STOP))[0]
    assert ctx.finish_reason == "length" and len(prompt) + len(ctx.token_ids) == 40


def test_default_stop_ids_are_the_models_eos():
    model = tiny_llama()
    model.generation_config.eos_token_id = [2, 7]
    engine = make_engine(model)
    assert set(engine.eos_ids) == {2, 7}


def test_seed_makes_sampling_reproducible_regardless_of_batch():
    model = tiny_llama()
    engine = make_engine(model)
    prompt = random_prompts([6])
    params = SamplingParams(max_new_tokens=10, n=2, seed=11, stop_token_ids=NO_STOP)
    alone = engine.generate(prompt, params)
    crowded = engine.generate(random_prompts([9, 4], seed=5) + prompt, params)[-2:]
    assert [c.token_ids for c in alone] == [c.token_ids for c in crowded]
    assert alone[0].token_ids != alone[1].token_ids


def test_abort_returns_an_abort_completion():
    engine = make_engine(tiny_llama())
    ids = engine.submit(random_prompts([5])[0], SamplingParams(max_new_tokens=50, n=2, stop_token_ids=NO_STOP))
    engine.step()
    engine.step()
    assert engine.abort([ids[0]]) and not engine.abort(["nope"])
    done = []
    while engine.num_unfinished or not done:
        done += engine.step()
    by_id = {c.request_id: c for c in done}
    assert by_id[ids[0]].finish_reason == "abort" and len(by_id[ids[0]].token_ids) == 2
    assert by_id[ids[1]].finish_reason == "length" and engine.stats()["num_free_blocks"] == 128


@pytest.mark.parametrize("prompt,params,match", [
    ([], SamplingParams(), "empty prompt"),
    ([5, 256], SamplingParams(), "outside the vocabulary"),
    ([5, -1], SamplingParams(), "outside the vocabulary"),
    (list(range(3, 103)) * 6, SamplingParams(), "no room in the context"),
    (list(range(3, 200)), SamplingParams(max_new_tokens=300), "KV blocks"),
    ([5], SamplingParams(stop_token_ids=[999]), "stop token id 999"),
])
def test_bad_requests_raise_and_leave_engine_usable(prompt, params, match):
    model = tiny_llama()
    engine = make_engine(model, num_blocks=100)
    with pytest.raises(ValueError, match=match):
        engine.submit(prompt, params)
    done = engine.generate(random_prompts([4]), SamplingParams(max_new_tokens=5, stop_token_ids=NO_STOP))
    assert len(done[0].token_ids) == 5 and engine.num_unfinished == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"n": 0}, "n must be"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -1}, "top_k"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
