"""unison.engine.cudnn_attention on the CPU: which layers it takes, the graphs' shapes, a row's padded lengths, and
that the fused training kernels turn it on. Its numbers against flash's: tests/test_cudnn_attention_gpu.py."""

import pytest
import torch

from unison.engine import cudnn_attention as ca
from unison.train.logprobs import training_kernels


def qkv(tokens=12, heads=4, kv_heads=2, width=64, dtype=torch.bfloat16, v_width=None):
    return (torch.zeros(tokens, heads, width, dtype=dtype), torch.zeros(tokens, kv_heads, width, dtype=dtype),
            torch.zeros(tokens, kv_heads, v_width or width, dtype=dtype))


def test_takes_plain_causal_layers_of_half_precision():
    assert ca.takes(*qkv(), None, None, None)
    assert ca.takes(*qkv(dtype=torch.float16, width=128, kv_heads=4), None, None, None)


@pytest.mark.parametrize("why, args, layer", [
    ("fp32", dict(dtype=torch.float32), {}),
    ("a sliding window", {}, dict(window=8)),
    ("sinks", {}, dict(sinks=torch.zeros(4))),
    ("a softcap", {}, dict(softcap=30.0)),
    ("values of another width (MLA)", dict(v_width=32), {}),
    ("heads wider than 128", dict(width=192), {}),
    ("a width not divisible by 8", dict(width=60), {}),
    ("query heads not a multiple of the KV heads", dict(heads=6, kv_heads=4), {}),
])
def test_refuses_what_its_graphs_do_not_compute(why, args, layer):
    assert not ca.takes(*qkv(**args), layer.get("window"), layer.get("sinks"), layer.get("softcap")), why


def test_never_runs_outside_packed_rows_or_on_the_cpu():
    assert not ca.runs(*qkv(), None, None, None)
    with ca.packed_rows():
        assert not ca.runs(*qkv(), None, None, None)  # CPU tensors


@pytest.mark.parametrize("sequences, longest, graph", [
    (1, 1, (8, 128)), (8, 128, (8, 128)), (9, 129, (16, 256)), (28, 576, (32, 1024)), (22, 1161, (32, 2048)),
    (64, 16384, (64, 16384))])
def test_graph_shapes_are_powers_of_two(sequences, longest, graph):
    assert ca.buckets(sequences, longest) == graph


def test_a_row_is_padded_with_empty_sequences():
    cu = torch.tensor([0, 5, 12, 18], dtype=torch.int32)
    row = ca._row(cu, 7, 18)
    assert (row.sequences, row.longest, row.tokens) == (8, 128, 32)
    assert row.lengths.flatten().tolist() == [5, 7, 6, 0, 0, 0, 0, 0]
    assert row.starts.flatten().tolist() == [0, 5, 12, 18, 18, 18, 18, 18, 18]
    assert ca._row(cu, 7, 18) is row  # every layer of the row: computed once
    other = ca._row(torch.tensor([0, 3], dtype=torch.int32), 3, 3)
    assert other is not row and other.lengths.flatten().tolist() == [3, 0, 0, 0, 0, 0, 0, 0]


def test_the_fused_training_kernels_turn_it_on():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert ca._active == 0
    with training_kernels(model, True) as on:
        assert on and ca._active == 1
    with training_kernels(model, False) as on:
        assert not on and ca._active == 0
    assert ca._active == 0


def test_ragged_offsets_count_elements_per_head_layout():
    row = ca._row(torch.tensor([0, 4, 10], dtype=torch.int32), 6, 10)
    names = ["lengths_q", "lengths_kv", "q_start", "k_start", "v_start", "o_start", "do_start", "dq_start",
             "dk_start", "dv_start"]
    t = {name: name for name in names}  # the graph's tensors stand in as their names
    key = ("bwd", 0, torch.bfloat16, 4, 2, 8, 0.35, row.sequences, row.longest, row.tokens, False)
    pack = ca._offsets(t, row, key)
    starts = [0, 4, 10] + [10] * 6  # two sequences and six empty ones
    for name in ("q_start", "o_start", "do_start", "dq_start"):
        assert pack[name].flatten().tolist() == [s * 4 * 8 for s in starts], name
    for name in ("k_start", "v_start", "dk_start", "dv_start"):
        assert pack[name].flatten().tolist() == [s * 2 * 8 for s in starts], name
    assert pack["lengths_q"] is row.lengths and pack["lengths_kv"] is row.lengths
    assert ca._offsets(t, row, key) is pack  # once per row and graph
