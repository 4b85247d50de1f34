"""Packing: round trip, first-fit-decreasing placement, padding segments, and no cross-sample leakage."""

import random
from itertools import pairwise

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import unison.engine.attention  # noqa: F401  (registers attn_implementation="unison")
from unison.engine.attention import NO_MASK
from unison.rollout.sample import Sample
from unison.train.logprobs import policy_logprobs
from unison.train.packing import PackedRow, balanced_rows, first_fit_decreasing, pack_samples

VOCAB = 256
PAD = 0


def make_sample(prompt_len: int, completion_len: int, seed: int, advantage: float = 0.5) -> Sample:
    rng = random.Random(seed)
    return Sample(
        prompt_ids=tuple(rng.randrange(1, VOCAB) for _ in range(prompt_len)),
        completion_ids=tuple(rng.randrange(1, VOCAB) for _ in range(completion_len)),
        engine_logprobs=tuple(-rng.random() * 5 for _ in range(completion_len)),
        weight_versions=(0,) * completion_len,
        reward=1.0,
        advantage=advantage,
    )


def check_row(row: PackedRow, samples: list[Sample], pad_id: int) -> None:
    """Every segment decodes back to its sample; targets, mask, advantages and logprobs line up."""
    t = row.num_tokens
    assert row.input_ids.shape == row.position_ids.shape == (1, t)
    assert row.input_ids.dtype == row.position_ids.dtype == row.targets.dtype == torch.int64
    assert row.loss_positions.dtype == torch.int64  # found on the host: the mask's true positions, in order
    assert row.loss_positions.tolist() == row.loss_mask.nonzero().squeeze(1).tolist()
    assert row.cu_seqlens.dtype == torch.int32 and row.loss_mask.dtype == torch.bool
    assert row.advantages.dtype == row.engine_logprobs.dtype == torch.float32
    cu = row.cu_seqlens.tolist()
    assert cu[0] == 0 and cu[-1] == t and all(b > a for a, b in pairwise(cu))
    assert row.max_seqlen == max(b - a for a, b in pairwise(cu))
    assert len(cu) - 1 in (row.num_samples, row.num_samples + 1)
    for k, (a, b) in enumerate(pairwise(cu)):
        assert row.position_ids[0, a:b].tolist() == list(range(b - a))
        if k >= row.num_samples:  # the padding segment
            assert row.input_ids[0, a:b].tolist() == [pad_id] * (b - a)
            assert not row.loss_mask[a:b].any() and not row.advantages[a:b].any()
            continue
        s = samples[row.sample_index[k]]
        tokens = list(s.prompt_ids) + list(s.completion_ids)
        assert row.input_ids[0, a:b].tolist() == tokens
        assert row.targets[a:b - 1].tolist() == tokens[1:]
        p = len(s.prompt_ids)
        expected_mask = [t >= p - 1 and t < len(tokens) - 1 for t in range(len(tokens))]
        assert row.loss_mask[a:b].tolist() == expected_mask
        m = row.loss_mask[a:b]
        assert row.targets[a:b][m].tolist() == list(s.completion_ids)
        assert torch.equal(row.engine_logprobs[a:b][m], torch.tensor(s.engine_logprobs, dtype=torch.float32))
        assert (row.advantages[a:b][m] == s.advantage).all()
        assert not row.advantages[a:b][~m].any() and not row.engine_logprobs[a:b][~m].any()


def test_round_trip_every_sample_once():
    rng = random.Random(0)
    samples = [make_sample(rng.randint(1, 9), rng.randint(1, 12), seed=i, advantage=i - 5.0) for i in range(23)]
    rows = pack_samples(samples, max_tokens_per_row=24, pad_id=PAD)
    placed = sorted(i for row in rows for i in row.sample_index)
    assert placed == list(range(len(samples)))
    for row in rows:
        assert row.num_tokens <= 24
        assert len(row.cu_seqlens) == row.num_samples + 1  # pad_to=1: no padding segment
        check_row(row, samples, PAD)
    assert sum(r.num_loss_tokens for r in rows) == sum(len(s.completion_ids) for s in samples)


def test_padding_is_its_own_segment():
    samples = [make_sample(4, 5, seed=1), make_sample(2, 2, seed=2)]  # 9 + 4 = 13 tokens
    (row,) = pack_samples(samples, max_tokens_per_row=32, pad_id=7, pad_to=8)
    assert row.num_tokens == 16
    assert row.cu_seqlens.tolist() == [0, 9, 13, 16]
    assert row.position_ids[0, 13:].tolist() == [0, 1, 2]
    check_row(row, samples, pad_id=7)
    # Already a multiple: no empty segment is added.
    (row,) = pack_samples([make_sample(3, 5, seed=3)], max_tokens_per_row=32, pad_id=7, pad_to=8)
    assert row.cu_seqlens.tolist() == [0, 8]


def test_first_fit_decreasing_placement():
    lengths = [2, 6, 3, 5, 4]
    assert first_fit_decreasing(lengths, 10) == [[1, 4], [3, 2, 0]]
    samples = [make_sample(1, n - 1, seed=i) for i, n in enumerate(lengths)]
    rows = pack_samples(samples, max_tokens_per_row=10, pad_id=PAD)
    assert [r.sample_index for r in rows] == [(1, 4), (3, 2, 0)]
    assert [r.cu_seqlens.tolist() for r in rows] == [[0, 6, 10], [0, 5, 8, 10]]


def test_rows_after_the_first_are_balanced_without_adding_rows():
    # First-fit-decreasing fills rows in turn: 30, 30, 30 and 10 tokens. Now the first stays full and the others
    # share the rest: 30, 20, 20, 20.
    assert first_fit_decreasing([10] * 10, 32) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert balanced_rows([10] * 10, 32) == [[0, 1, 2], [3, 6, 9], [4, 7], [5, 8]]
    # A GRPO step's 64 samples of 576 tokens in rows of 16384: three rows either way.
    rows = balanced_rows([576] * 64, 16384)
    assert [len(r) * 576 for r in first_fit_decreasing([576] * 64, 16384)] == [16128, 16128, 4608]
    assert [len(r) * 576 for r in rows] == [16128, 10368, 10368]
    # Two rows, or where the emptiest-bin order cannot place everything: first-fit-decreasing's bins stand.
    assert balanced_rows([2, 6, 3, 5, 4], 10) == first_fit_decreasing([2, 6, 3, 5, 4], 10)
    assert balanced_rows([9, 9, 9, 2, 2, 2, 2], 10) == first_fit_decreasing([9, 9, 9, 2, 2, 2, 2], 10)
    rng = random.Random(1)
    for _ in range(300):
        lengths = [rng.randint(1, 20) for _ in range(rng.randint(1, 40))]
        rows, ffd = balanced_rows(lengths, 24), first_fit_decreasing(lengths, 24)
        assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
        assert len(rows) == len(ffd) and rows[0] == ffd[0]
        assert all(sum(lengths[i] for i in r) <= 24 for r in rows)
        if len(rows) > 2:  # the shortest row after the first is no shorter than first-fit-decreasing's
            assert min(sum(lengths[i] for i in r) for r in rows[1:]) >= min(sum(lengths[i] for i in r) for r in ffd)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"12 tokens.*max_tokens_per_row \(10\)"):
        pack_samples([make_sample(2, 3, 0), make_sample(4, 8, 1)], max_tokens_per_row=10, pad_id=PAD)
    with pytest.raises(ValueError, match="multiple of pad_to"):
        pack_samples([make_sample(2, 3, 0)], max_tokens_per_row=10, pad_id=PAD, pad_to=4)
    assert pack_samples([], max_tokens_per_row=10, pad_id=PAD) == []


def test_completion_mask_leaves_context_tokens_out():
    """A multi-turn sample's context tokens (mask False) are predicted by no loss position and carry no advantage;
    the model's tokens keep their engine logprobs; padding after it stays out."""
    s = make_sample(3, 6, seed=4, advantage=-1.5)
    turns = (True, True, False, False, True, True)
    s = Sample(s.prompt_ids, s.completion_ids, s.engine_logprobs, s.weight_versions, s.reward, s.advantage,
               completion_mask=turns)
    (row,) = pack_samples([make_sample(2, 2, seed=5), s], max_tokens_per_row=32, pad_id=PAD, pad_to=8)
    assert row.sample_index == (1, 0) and row.cu_seqlens.tolist() == [0, 9, 13, 16]
    assert s.num_loss_tokens == 4 and row.num_loss_tokens == 4 + 2  # and the other sample's two
    assert row.loss_mask[:9].tolist() == [False, False] + list(turns) + [False]
    assert row.targets[row.loss_mask][:4].tolist() == [t for t, m in zip(s.completion_ids, turns, strict=True) if m]
    assert row.advantages[:9].tolist() == [0.0, 0.0] + [-1.5 if m else 0.0 for m in turns] + [0.0]
    expected = torch.tensor(s.engine_logprobs, dtype=torch.float32)
    assert torch.equal(row.engine_logprobs[2:8], expected)
    assert row.loss_positions.tolist() == row.loss_mask.nonzero().squeeze(1).tolist()
    assert not row.loss_mask[13:].any() and row.input_ids[0, 13:].tolist() == [PAD] * 3


def test_to_moves_tensors_and_keeps_metadata():
    (row,) = pack_samples([make_sample(3, 4, 0)], max_tokens_per_row=16, pad_id=PAD)
    moved = row.to("meta")
    assert moved.input_ids.is_meta and moved.cu_seqlens.is_meta and moved.loss_mask.is_meta
    assert moved.sample_index == row.sample_index and moved.max_seqlen == row.max_seqlen
    assert row.input_ids.device.type == "cpu"


def tiny_llama() -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32)


def tiny_qwen3() -> torch.nn.Module:
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    return Qwen3ForCausalLM._from_config(cfg, attn_implementation="unison", dtype=torch.float32)


def sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """Larger weights than the 0.02-std init, so attention is peaked and any leakage shows in logprobs."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.2)
    return model.eval()


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_packed_logprobs_equal_per_sample(build):
    model = sharpen(build())
    samples = [make_sample(p, c, seed=10 + i) for i, (p, c) in enumerate([(7, 9), (3, 12), (11, 4), (5, 6)])]
    (row,) = pack_samples(samples, max_tokens_per_row=64, pad_id=PAD, pad_to=16)
    assert row.num_samples == 4 and len(row.cu_seqlens) == 6  # four samples and a padding segment
    temperature = 0.7
    with torch.no_grad():
        packed, _ = policy_logprobs(model, row, temperature=temperature, chunk_size=5)
        expected = []
        for k in row.sample_index:
            s = samples[k]
            ids = torch.tensor([list(s.prompt_ids) + list(s.completion_ids)])
            logits = model(input_ids=ids).logits[0].float() / temperature
            logp = torch.log_softmax(logits, -1)[len(s.prompt_ids) - 1:-1]
            expected.append(logp.gather(1, torch.tensor(s.completion_ids)[:, None]).squeeze(1))
        expected = torch.cat(expected)
        torch.testing.assert_close(packed, expected, rtol=0, atol=1e-5)
        # Control: the same row attended as one sequence must differ, or the comparison proves nothing.
        leaky = model(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=NO_MASK,
                      cu_seq_lens_q=torch.tensor([0, row.num_tokens], dtype=torch.int32),
                      cu_seq_lens_k=torch.tensor([0, row.num_tokens], dtype=torch.int32),
                      max_length_q=row.num_tokens, max_length_k=row.num_tokens).logits[0] / temperature
        leaky = torch.log_softmax(leaky, -1)[row.loss_mask].gather(1, row.targets[row.loss_mask, None]).squeeze(1)
        assert (leaky - expected).abs().max() > 1e-2
