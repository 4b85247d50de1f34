"""The overlapped decode (EngineConfig.async_scheduling) on the CPU, through the runner and the fused sampler in
Triton's interpreter: the same tokens, logprobs, versions and completions as synchronous steps, whatever stops,
aborts, weight updates, multi-turn continuations and lending happen while a step is in flight."""

from __future__ import annotations

import pytest
import torch
from conftest import max_logprob_diff, random_prompts, tiny_llama, tiny_qwen3

from unison.engine import Engine, EngineConfig, SamplingParams

pytest.importorskip("triton")

STOPS = tuple(range(3, 40))  # ~15% of a tiny model's 256 tokens: most requests stop early, at different steps


def engines(make, **kw):
    cfg = dict(num_blocks=96, block_size=4, max_batch_tokens=64, seed=0, attention="triton", max_num_seqs=16)
    cfg.update(kw)
    model = make()
    return model, [Engine(model, EngineConfig(**cfg, async_scheduling=a)) for a in (False, True)]


def same(a, b):
    assert (a.request_id, a.token_ids, a.finish_reason, a.weight_versions) == \
        (b.request_id, b.token_ids, b.finish_reason, b.weight_versions)
    assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0) < 1e-5


def run(engine, submissions):
    for prompt, params in submissions:
        engine.submit(prompt, params)
    done = []
    while engine.num_unfinished:
        done += engine.step()
    return sorted(done, key=lambda c: c.request_id)


def test_overlapped_decode_equals_synchronous():
    """Groups of seeded samples that stop on tokens at different steps, and at different length limits: every
    completion as the synchronous engine's, the decode steps launched ahead, and the guessed rows thrown away."""
    model, (sync, overlapped) = engines(tiny_llama)
    prompts = random_prompts([5, 9, 3, 12])
    subs = [(p, SamplingParams(max_new_tokens=5 + 3 * i, n=2, seed=10 + i, stop_token_ids=STOPS))
            for i, p in enumerate(prompts)]
    a, b = run(sync, subs), run(overlapped, subs)
    for x, y in zip(a, b, strict=True):
        same(x, y)
    assert {c.finish_reason for c in a} == {"stop", "length"}
    stats, base = overlapped.stats(), sync.stats()
    assert stats["ahead_steps"] > 5 and base["ahead_steps"] == 0
    assert stats["tokens_generated"] == base["tokens_generated"] == sum(len(c.token_ids) for c in a)
    assert stats["tokens_computed"] > base["tokens_computed"]  # the rows of requests that had stopped
    assert max_logprob_diff(model, b) < 1e-4  # the KV written ahead is the real tokens'


def test_abort_update_and_lend_between_overlapped_steps():
    """The same calls on both engines between steps: an abort, an in-place weight update with its version, a
    lend of the KV pool; the in-flight step's token belongs to the old weights."""
    model, engs = engines(tiny_qwen3)  # q_norm / k_norm: the other attention layout
    prompts = random_prompts([4, 7, 10])
    results = []
    for engine in engs:
        torch.manual_seed(0)
        ids = [engine.submit(p, SamplingParams(max_new_tokens=12, seed=i, stop_token_ids=()))[0]
               for i, p in enumerate(prompts)]
        done = []
        for _ in range(5):
            done += engine.step()
        engine.abort([ids[1]])
        for _ in range(3):
            done += engine.step()
        with torch.no_grad():
            model.model.norm.weight.mul_(1.5)  # an optimizer step, in place
        engine.weights_updated(1)
        for _ in range(3):
            done += engine.step()
        with engine.lend():
            pass
        while engine.num_unfinished:
            done += engine.step()
        with torch.no_grad():
            model.model.norm.weight.div_(1.5)
        results.append(sorted(done, key=lambda c: c.request_id))
    for x, y in zip(*results, strict=True):
        same(x, y)
    aborted = next(c for c in results[1] if c.finish_reason == "abort")
    assert len(aborted.token_ids) == 5 and set(aborted.weight_versions) == {0}
    versions = next(c for c in results[1] if c.request_id == "g0-0").weight_versions
    assert versions[7] == 0 and versions[8] == 1 and len(versions) == 12
    assert engs[1].stats()["ahead_steps"] > 5


def test_overlapped_multi_turn_continuation():
    """Continuable samples that stop on a token are extended with a tool's turn: the position of the token computed
    ahead is recomputed with the real next token (the same completions and logprobs as synchronous steps)."""
    model, engs = engines(tiny_llama)
    prompts = random_prompts([6, 8])
    results = []
    for engine in engs:
        ids = [rid for i, p in enumerate(prompts) for rid in engine.submit(
            p, SamplingParams(max_new_tokens=8, n=2 - i, seed=i, stop_token_ids=STOPS), continuable=True)]
        turns = []
        for turn in range(2):
            done = []
            while engine.num_unfinished:
                done += engine.step()
            turns.append(sorted(done, key=lambda c: c.request_id))
            if turn < 1:
                for rid in ids:
                    engine.extend(rid, [41 + turn, 42, 43])
        engine.release(ids)
        results.append(turns)
    for turn_a, turn_b in zip(*results, strict=True):
        for x, y in zip(turn_a, turn_b, strict=True):
            same(x, y)
    assert max_logprob_diff(model, results[1][-1]) < 1e-4
    assert engs[1].stats()["ahead_steps"] > 0


def test_releasing_nothing_leaves_the_step_in_flight():
    """Engine.release drains the step in flight before it frees parked KV; with nothing to free it leaves that step
    in flight (the multi-turn loop's steps where no episode ended), and a parked request is freed as before."""
    _, (_, engine) = engines(tiny_llama)
    (rid,) = engine.submit(random_prompts([5])[0], SamplingParams(max_new_tokens=12, seed=0, stop_token_ids=()),
                           continuable=True)
    while not engine._overlap.steps:
        engine.step()
    assert engine.release([]) == 0 and engine.release(iter(())) == 0
    assert engine._overlap.steps  # still in flight
    done = []
    while engine.num_unfinished:
        done += engine.step()
    assert [len(c.token_ids) for c in done] == [12] and engine.stats()["num_parked"] == 1
    assert engine.release([rid]) == 1 and engine.stats()["num_parked"] == 0


def test_a_continuation_leaves_the_step_in_flight():
    """A continuable request stops on a token while two others decode on; it is extended (then released) after
    the step holding its guessed row has come back, as the multi-turn loop does when a reply comes a step or more
    later: the overlapped engine does both with its other step still in flight, and every completion is the
    synchronous engine's. Extended at once by one token while four others decode, its guess is still in flight: the
    engine leaves that step in flight too, and no launch ahead continues the guess (without that check the held
    reply's decode launched ahead is fed the guessed token, and its logprobs differ from the synchronous engine's by
    0.13)."""
    # Held for at most 16 steps, the extension's second turn ends while the others still decode (so its release
    # happens with a step in flight too); held for longer it would run alone, after them.
    model, engs = engines(tiny_llama, prefill_wait_steps=16)
    prompts = random_prompts([6, 8, 5])
    results, kept_in_flight = [], []
    for engine in engs:
        (rid,) = engine.submit(prompts[0], SamplingParams(max_new_tokens=30, seed=3, stop_token_ids=STOPS),
                               continuable=True)
        for i, p in enumerate(prompts[1:]):
            engine.submit(p, SamplingParams(max_new_tokens=24, seed=i, stop_token_ids=()))
        done, turn, since, flags = [], 0, None, []
        while engine.num_unfinished:
            out = engine.step()
            done += out
            if any(c.request_id == rid for c in out):
                since = 0
            elif since is not None:
                since += 1
            if since == 1 and turn < 1:  # one step after its completion: its guess has come back
                turn, since = turn + 1, None
                engine.extend(rid, [41 + turn, 42, 43])
                flags.append(bool(engine._overlap and engine._overlap.steps))
            if since == 1 and turn == 1:
                engine.release([rid])
                flags.append(bool(engine._overlap and engine._overlap.steps))
                since = None
        results.append(sorted(done, key=lambda c: (c.request_id, len(c.prompt_ids))))
        kept_in_flight.append(flags)
    assert len(results[0]) == len(results[1]) == 4  # two turns of the continued request, two others
    for x, y in zip(*results, strict=True):
        same(x, y)
    assert max_logprob_diff(model, results[1]) < 1e-4
    assert kept_in_flight[0] == [False, False]  # synchronous: nothing ever in flight
    assert kept_in_flight[1] == [True, True], kept_in_flight[1]
    turns, in_flight = [], []
    for engine in engs:  # extended at once, while its guess is in flight
        (rid2,) = engine.submit(prompts[0], SamplingParams(max_new_tokens=30, seed=3, stop_token_ids=STOPS),
                                continuable=True)
        for i, p in enumerate(prompts):  # more decode than wait: the reply's prefill is held, decoding goes ahead
            engine.submit(p, SamplingParams(max_new_tokens=10, seed=i, stop_token_ids=()))
        while not any(c.request_id == rid2 for c in engine.step()):
            pass
        guessed = any(req.request_id == rid2 for s in (engine._overlap.steps if engine._overlap else ())
                      for req, _ in s.rows)
        engine.extend(rid2, [44])
        in_flight.append((guessed, bool(engine._overlap and engine._overlap.steps)))
        done = []
        while engine.num_unfinished:
            done += engine.step()
        turns.append(sorted(done, key=lambda c: c.request_id))
    assert in_flight == [(False, False), (True, True)]  # (its guess in flight, a step in flight after extend)
    for x, y in zip(*turns, strict=True):
        same(x, y)
