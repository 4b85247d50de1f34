"""New prefill work held back while others decode (``EngineConfig.prefill_wait_steps``): the scheduler's rules,
driven step by step (work that arrives within that many steps of the last prefill waits out the rest, then goes
together), and the engine's multi-turn episodes with staggered tool replies, which then share eager prefill steps
and generate the same completions."""

from __future__ import annotations

import pytest
from conftest import max_logprob_diff, random_prompts, tiny_llama

from unison.engine import Engine, EngineConfig, SamplingParams
from unison.engine.cache import BlockAllocator
from unison.engine.scheduler import Request, Scheduler

BLOCK = 4


def scheduler(wait: int, budget: int = 64) -> Scheduler:
    return Scheduler(BlockAllocator(64), BLOCK, budget, max_num_seqs=16, prefix_caching=False, prefill_wait=wait)


def request(i: int, prompt: int = 5, new: int = 50) -> Request:
    return Request(f"r{i}", f"g{i}", list(range(3, 3 + prompt)), SamplingParams(max_new_tokens=new), frozenset(),
                   prompt + new, arrival=i)


def step(s: Scheduler) -> tuple[bool, list[tuple[str, int]]]:
    """One engine step as the engine drives the scheduler: ask whether it holds, schedule, 'compute' the chunks
    and append a token to every request that samples. Returns (held, [(request id, chunk length)])."""
    hold = s.holds()
    chunks = s.schedule(hold)
    s.after_forward(chunks)
    for c in chunks:
        if c.samples:
            c.request.output.append(7)
    return hold, [(c.request.request_id, c.length) for c in chunks]


def decoding(s: Scheduler, n: int) -> None:
    for i in range(n):
        s.add(request(i))
    while s.waiting or any(r.num_tokens - r.num_computed > 1 for r in s.running):
        assert not step(s)[0]  # their prefill (as many wait as decode: not held)
    assert [r.num_tokens - r.num_computed for r in s.running] == [1] * n


@pytest.mark.parametrize("wait", [0, 1, 5])
def test_a_prompt_arriving_soon_after_a_prefill_waits_while_more_requests_decode(wait):
    s = scheduler(wait)
    decoding(s, 4)  # the last step prefilled
    s.add(request(9))
    for _ in range(wait):
        held, chunks = step(s)
        assert held and chunks == [(f"r{i}", 1) for i in range(4)]  # a decode-only step: the CUDA graphs' kind
    held, chunks = step(s)
    assert not held and chunks == [(f"r{i}", 1) for i in range(4)] + [("r9", 5)]
    assert not s.holds() and not s.waiting


def test_a_prompt_arriving_after_a_quiet_spell_is_prefilled_at_once():
    """More than ``prefill_wait`` decode-only steps since the last prefill: arrivals are rare, nothing to batch."""
    s = scheduler(3)
    decoding(s, 4)
    for _ in range(3):
        assert step(s) == (False, [(f"r{i}", 1) for i in range(4)])
    s.add(request(9))
    held, chunks = step(s)
    assert not held and chunks[-1] == ("r9", 5)
    s.add(request(10))  # right after that prefill: held for three steps
    assert [step(s)[0] for _ in range(4)] == [True, True, True, False]


def test_nothing_is_held_while_as_many_wait_as_decode_or_nothing_decodes():
    s = scheduler(8)
    assert not s.holds()
    decoding(s, 2)
    s.add(request(7))
    s.add(request(8))
    held, chunks = step(s)
    assert not held and ("r7", 5) in chunks and ("r8", 5) in chunks


def test_nothing_is_held_while_a_prefill_is_under_way():
    s = scheduler(8, budget=6)
    decoding(s, 1)  # (budget 6: its 5-token prompt fits)
    s.add(request(5, prompt=12))  # a 12-token prompt in chunks of what the budget leaves
    s.add(request(6))
    s.add(request(7))
    held, chunks = step(s)  # three wait, one decodes: not held
    assert not held and chunks == [("r0", 1), ("r5", 5)]
    s.add(request(8))
    assert not s.holds()  # r5's prompt is partway: the step is eager anyway


def test_once_due_the_held_work_is_scheduled_step_after_step_as_the_budget_allows():
    s = scheduler(2, budget=9)  # the decoding rows and one prompt a step, no prompt split
    decoding(s, 4)
    for i in range(5, 8):
        s.add(request(i, prompt=10 - i))  # 5, 4 and 3 tokens
    assert [step(s)[0] for _ in range(2)] == [True, True]
    for i in range(5, 8):  # due: one prompt a step, never held again though more decode than wait
        held, chunks = step(s)
        assert not held and chunks[-1] == (f"r{i}", 10 - i) and len(chunks) == i
    assert not s.waiting
    s.add(request(8))  # the next arrival waits from zero
    assert [step(s)[0] for _ in range(3)] == [True, True, False]


def test_a_resumed_requests_new_tokens_are_held_and_a_preempted_one_leaves_the_held_set():
    s = scheduler(3)
    decoding(s, 4)
    first = s.running[0]
    first.continuable = True
    s.finish(first)
    first.prompt = first.prompt + first.output + [11, 12, 13]  # what Engine.extend does to it
    first.output = []
    s.resume(first)
    assert s.resumed == {"r0": first}
    for _ in range(3):
        held, chunks = step(s)
        assert held and chunks == [(f"r{i}", 1) for i in range(1, 4)]
    held, chunks = step(s)
    assert not held and chunks[0] == ("r0", 4) and not s.resumed  # its 3 new tokens and the re-fed last one
    s2 = scheduler(3)
    decoding(s2, 3)
    req = s2.running[-1]
    req.continuable = True
    s2.finish(req)
    req.prompt, req.output = req.prompt + req.output + [11, 12], []
    s2.resume(req)
    s2.preempt(req)
    assert not s2.resumed and list(s2.waiting) == [req]


def staggered_episodes(engine: Engine, prompts, turns: int = 3) -> list:
    """Continuable requests whose turns end at different steps (each turn its own length), each extended with a
    three-token 'tool reply' as soon as its turn comes out of step(): the replies land on different steps."""
    ids = {}
    for i, p in enumerate(prompts):
        (rid,) = engine.submit(p, SamplingParams(max_new_tokens=3 + 2 * i, seed=i, stop_token_ids=()),
                               continuable=True)
        ids[rid] = i
    turn = dict.fromkeys(ids, 1)
    done = []
    while engine.num_unfinished:
        for c in engine.step():
            done.append(c)
            i = ids[c.request_id]
            if turn[c.request_id] < turns:
                turn[c.request_id] += 1
                engine.extend(c.request_id, [41 + i, 42, 43],
                              SamplingParams(max_new_tokens=2 + (3 * i + turn[c.request_id]) % 5, seed=i,
                                             stop_token_ids=()))
    engine.release(list(ids))
    return sorted(done, key=lambda c: (c.request_id, len(c.prompt_ids)))


def test_staggered_tool_replies_share_eager_steps_and_generate_the_same_episodes():
    """Eight episodes of three turns whose tool replies land on different steps: held (the default), their
    prefills share eager steps (6 instead of 11 when written), and every turn's tokens and logprobs are those of
    the engine that prefills each reply at once."""
    model = tiny_llama()
    prompts = random_prompts([6, 9, 4, 7, 5, 8, 3, 10])
    results, eager = [], []
    for wait in (0, EngineConfig().prefill_wait_steps):
        engine = Engine(model, EngineConfig(num_blocks=96, block_size=4, max_batch_tokens=64, seed=0,
                                            attention="triton", max_num_seqs=16, prefill_wait_steps=wait))
        results.append(staggered_episodes(engine, prompts))
        stats = engine.stats()
        eager.append(stats["steps"] - stats["graph_steps"])
    assert len(results[0]) == len(results[1]) == 24
    for a, b in zip(*results, strict=True):
        assert (a.request_id, a.prompt_ids, a.token_ids, a.finish_reason) == \
            (b.request_id, b.prompt_ids, b.token_ids, b.finish_reason)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    assert max_logprob_diff(model, results[1]) < 1e-4
    assert eager[1] <= eager[0] - 4, eager
