"""The one attention function: plain forwards equal SDPA, packed forwards never cross segments."""

from __future__ import annotations

import torch
from conftest import tiny_llama, tiny_qwen3
from transformers import LlamaForCausalLM

from unison.engine import NO_MASK
from unison.engine.cache import BlockAllocator, prefix_hashes


def test_plain_forward_equals_sdpa_with_padding():
    model = tiny_llama()
    ref = LlamaForCausalLM._from_config(type(model.config)(**model.config.to_dict()), attn_implementation="sdpa")
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(3, 256, (2, 17))
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[1, :6] = 0
    a = model(ids, attention_mask=mask).logits
    b = ref.eval()(ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "unison"
    assert torch.equal(a, b)


def test_packed_forward_never_attends_across_segments():
    for model in (tiny_llama(), tiny_qwen3()):
        lengths = [7, 1, 13, 4]
        ids = torch.randint(3, 256, (1, sum(lengths)))
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        packed = model(ids, position_ids=pos, attention_mask=NO_MASK, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                       max_length_q=max(lengths), max_length_k=max(lengths)).logits[0]
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
            alone = model(ids[:, start:end]).logits[0]
            assert (packed[start:end] - alone).abs().max() < 1e-5


def test_no_mask_without_metadata_is_an_error():
    model = tiny_llama()
    try:
        model(torch.tensor([[5, 6, 7]]), attention_mask=NO_MASK)
    except ValueError as e:
        assert "NO_MASK" in str(e)
    else:
        raise AssertionError("NO_MASK without metadata must raise")


def test_allocator_refcounts_and_prefix_cache():
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    h = prefix_hashes(list(range(8)), 4, 2)
    alloc.register(a[0], h[0])
    alloc.register(a[1], h[1])
    assert alloc.lookup(h) == ([], True)  # pending: registered but not computed yet
    alloc.mark_computed(a[0])
    assert alloc.lookup(h) == ([a[0]], True)
    alloc.mark_computed(a[1])
    alloc.acquire(a[0])
    alloc.release(a)  # a[1] back to free but still cached; a[0] still held once
    assert alloc.num_free == 3 and alloc.lookup(h) == (a, False)
    alloc.release([a[0]])
    alloc.allocate(3)  # LRU: the two never-used blocks first, then the oldest freed (a[1])
    assert alloc.lookup(h) == ([a[0]], False)
    alloc.clear_cache()
    assert alloc.lookup(h) == ([], False)
    assert prefix_hashes([1, 2, 3, 4, 5], 2, 2) != prefix_hashes([1, 2, 3, 5, 5], 2, 2)


def test_pool_slots_of_a_span_match_each_positions_block():
    """``slots_of`` (the engine's prefill slots, built with numpy) is block * size + offset for every position of
    any span, and ``context_slots`` is its span from position 0."""
    import random

    from unison.engine.backend import context_slots, slots_of

    rng = random.Random(0)
    for block_size in (1, 4, 16):
        table = rng.sample(range(1000), 40)
        for _ in range(50):
            start = rng.randrange(0, 40 * block_size)
            end = rng.randrange(start, 40 * block_size + 1)
            want = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            assert slots_of(table, start, end, block_size).tolist() == want
        length = rng.randrange(1, 40 * block_size + 1)
        assert context_slots(table, length, block_size).tolist() == slots_of(table, 0, length, block_size).tolist()
