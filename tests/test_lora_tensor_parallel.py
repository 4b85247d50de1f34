"""LoRA under tensor parallelism over gloo: two ranks, each holding half of every projection and of its adapter
(``lora_B`` of a column-wise base, ``lora_A`` of a row-wise one), decode the same tokens and make the same adapter
update as one process; `unison train --dist.tp=2` saves adapters that PEFT loads onto the unsharded base."""

from __future__ import annotations

import json

import pytest
import test_tensor_parallel
import torch
from peers.tp_peer import LORA, OPTIM, STEPS, run
from test_lora import check_saved_lora
from test_tensor_parallel import assert_decodes_and_trains_as_one_process, torchrun_train

from unison.config import ConfigError
from unison.lora import LoraConfig, shard_adapters
from unison.models import load_policy
from unison.train.optimizer import MasterAdamW

peft = pytest.importorskip("peft")
qwen3_dir = test_tensor_parallel.qwen3_dir  # the fixture: a tiny Qwen3 with one KV head per rank
two_ranks = test_tensor_parallel.two_ranks  # the fixture: one two-rank launch, its LoRA run on saved adapters


def test_lora_on_two_ranks_equals_one_process(two_ranks):
    ranks = [r["lora"] for r in two_ranks["ranks"]]

    model, _ = load_policy(two_ranks["model_dir"], dtype=torch.float32, lora=LORA,  # one process, whole
                           adapter=two_ranks["adapters"])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    single = run(model, lambda m: MasterAdamW(m.named_parameters(), OPTIM, STEPS))
    for r in ranks:
        # Each rank loaded its slices of the saved adapters: gathered, they are the whole ones.
        assert all(torch.equal(r["loaded"][name], value) for name, value in start.items())
        # 7 projections per layer and one adapter linear of each (lora_B column-wise on q/k/v/gate/up, lora_A
        # row-wise on o/down), all on their local shards, in the engine's forwards and in every training step.
        assert r["switched"] == 28 and r["training_switches"] == 28 * STEPS
        assert {"model.layers.0.self_attn.q_proj.lora_B.default.weight",
                "model.layers.0.mlp.down_proj.lora_A.default.weight"} <= set(r["sharded"])
        assert not {"model.layers.0.self_attn.q_proj.lora_A.default.weight",
                    "model.layers.0.mlp.down_proj.lora_B.default.weight"} & set(r["sharded"])
        assert_decodes_and_trains_as_one_process(r, single)
        for name, value in model.state_dict().items():
            if ".lora_" in name:  # as tests/test_tensor_parallel.py: fp32 summation order, amplified by AdamW
                torch.testing.assert_close(r["params"][name], value, rtol=0, atol=0.1 * OPTIM.lr, msg=name)
            else:  # the base stays frozen, bit for bit
                assert torch.equal(r["params"][name], start[name]), name
        for name, value in r["replicated"].items():  # the replicated adapters stay identical across ranks
            assert torch.equal(value, ranks[0]["replicated"][name]), name
    assert single["tokens_after"] != single["tokens"]  # the steps really moved the adapters
    moved = [n for n, v in model.state_dict().items() if not torch.equal(v, start[n])]
    assert moved and all(".lora_" in n for n in moved)


def test_torchrun_train_lora_with_tensor_parallelism_saves_peft_adapters_and_resumes(qwen3_dir, tmp_path):
    from safetensors.torch import load_file

    lora = ["--dist.tp=2", "--model.lora.r=4", "--model.lora.alpha=8", "--optim.lr=1e-2", "--loss.beta=0.1"]
    out = tmp_path / "run"
    torchrun_train(qwen3_dir, out, *lora, "--model.lora.save_merged=true", "--max_steps=1")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1] and records[0]["optim/changed_frac"] > 0
    ckpt = out / "checkpoint"
    # PEFT loads the adapters, whole, onto the unsharded base; the merged folder is the same policy.
    reference = load_policy(qwen3_dir, dtype=torch.float32, lora=LORA)[0]
    assert check_saved_lora(qwen3_dir, ckpt) == {n: p.shape for n, p in reference.named_parameters() if ".lora_" in n}
    # A resumed run loads each rank's slices of the saved adapters (and its optimizer state) and goes on.
    resumed = tmp_path / "resumed"
    torchrun_train(qwen3_dir, resumed, *lora, "--max_steps=2", f"--resume={ckpt}")
    (again,) = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert again["step"] == 2
    # The reference is the base (the adapters off): the same policy at the start (lora_B = 0), another after a resume
    # that loaded the trained adapters.
    assert records[0]["kl/ref_mean"] < 1e-7 < again["kl/ref_mean"], (records[0]["kl/ref_mean"], again["kl/ref_mean"])
    after = load_file(str(resumed / "checkpoint" / "adapter_model.safetensors"))
    first = load_file(str(ckpt / "adapter_model.safetensors"))
    assert set(after) == set(first) and any(not torch.equal(after[k], first[k]) for k in first)


def test_lora_dropout_under_tensor_parallelism_is_refused(qwen3_dir):
    """Each rank would draw its own masks for the replicated adapters: refused before anything is sharded."""
    model, _ = load_policy(qwen3_dir, dtype=torch.float32, lora=LoraConfig(r=4, dropout=0.1))
    with pytest.raises(ConfigError, match="model.lora.dropout=0"):
        shard_adapters(model, mesh=None)
