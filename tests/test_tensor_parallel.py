"""Tensor parallelism over gloo: two ranks holding half of each projection decode the same tokens (on the plain
local shards, with explicit all-reduces) and make the same update as one process holding the whole model;
`unison train --dist.tp=2` trains and saves a checkpoint.

Every launch starts interpreters that import torch and transformers (about half of a 50 s launch on two cores):
tests that can check the same launch share it (the ``two_ranks`` and ``tp_run`` fixtures)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_tokenizer
from peers.tp_peer import OPTIM, STEPS, run, saved_adapters
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from unison.config import load_config
from unison.dist.tensor_parallel import _fp32_product
from unison.models import load_policy
from unison.train.checkpoint import load_trainer_state
from unison.train.config import TrainConfig
from unison.train.optimizer import MasterAdamW

PEERS = os.path.join(os.path.dirname(__file__), "peers")


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory):
    """Qwen3 (per-head q/k norms, tied embeddings) with 4 query and 2 KV heads: one KV head per rank."""
    path = tmp_path_factory.mktemp("tiny_qwen3_tp")
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(path)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(peer: str, *args: str, out) -> list[dict]:
    """``peers/<peer>`` as ranks 0 and 1 of a gloo group; each saves ``out/rank<r>.pt``, returned in rank order."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(PEERS, peer), *args, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    for p in procs:
        out_text, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out_text[-3000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


_TWO_RANKS: dict = {}


@pytest.fixture(scope="session")
def two_ranks(qwen3_dir, tmp_path_factory) -> dict:
    """One two-rank launch of ``peers/tp_peer.py`` for the plain and the LoRA check (its LoRA run loads
    ``saved_adapters``; without peft there is none): ``ranks`` (each rank's results, ``"plain"`` and ``"lora"``) and
    the ``model_dir`` and ``adapters`` folders they loaded. Cached, as tests/test_lora_tensor_parallel.py imports
    the fixture and pytest would run it again for that module."""
    if not _TWO_RANKS:
        out = tmp_path_factory.mktemp("two_ranks")
        adapters = saved_adapters(qwen3_dir, out / "adapters") if importlib.util.find_spec("peft") else ""
        _TWO_RANKS.update(model_dir=qwen3_dir, adapters=adapters,
                          ranks=run_two_ranks("tp_peer.py", qwen3_dir, adapters, out=out))
    return _TWO_RANKS


def assert_decodes_and_trains_as_one_process(rank: dict, single: dict) -> None:
    """A rank's ``peers.tp_peer.run`` result against one process's: the same tokens before and after training;
    logprobs and gradient norms up to fp32 summation order."""
    assert rank["tokens"] == single["tokens"] and rank["tokens_after"] == single["tokens_after"]
    for key in ("logprobs", "logprobs_after"):
        diff = max(abs(a - b) for x, y in zip(rank[key], single[key], strict=True)
                   for a, b in zip(x, y, strict=True))
        assert diff < 1e-4, (key, diff)
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(rank["norms"], single["norms"], strict=True))


def test_two_ranks_equal_one_process(two_ranks):
    ranks = [r["plain"] for r in two_ranks["ranks"]]

    model, _ = load_policy(two_ranks["model_dir"], dtype=torch.float32)  # one process, the whole model
    start = {k: v.clone() for k, v in model.state_dict().items()}
    single = run(model, lambda m: MasterAdamW(m.named_parameters(), OPTIM, STEPS))
    for r in ranks:
        # The engine decodes on plain local shards: all 7 projections of both layers, DTensor's hooks set aside
        # for the block and back afterwards (the training forward needs them).
        assert r["local_forward"] == {"switched": 14, "hooks_inside": 0, "hooks_after": 1}
        assert r["training_switches"] == 14 * STEPS  # and so did every training step's forward and backward
        assert_decodes_and_trains_as_one_process(r, single)
        for name, value in model.state_dict().items():
            # Split matmuls sum in another order; AdamW turns that fp32 noise into up to a few % of one step (lr
            # 1e-3) on elements whose gradient is near zero. A wrong gradient moves elements by a whole step.
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=0.1 * OPTIM.lr, msg=name)
        for name, value in r["replicated"].items():  # replicated parameters stay identical across ranks
            assert torch.equal(value, ranks[0]["replicated"][name]), name
        assert r["host"]["norms"] == r["norms"]  # optimizer state in host memory: the same update, bit for bit
        for name, value in r["params"].items():
            assert torch.equal(r["host"]["params"][name], value), name
    assert single["norms"][0] > 0 and single["tokens_after"] != single["tokens"]  # the steps really moved it
    assert any("q_norm" in n and not torch.equal(v, start[n]) for n, v in model.state_dict().items())


def test_rowwise_partials_round_once_as_one_process():
    """A row-wise projection's two partial products, summed in fp32 and rounded once (``rowwise_reduce``), give
    the bf16 output one process gives; summing bf16 partials (as DTensor's Partial placement does) differs in
    over a third of the elements."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 512, generator=g).bfloat16(), torch.randn(256, 512, generator=g).bfloat16()
    one_process = F.linear(x, w)
    halves = [(x[:, :256], w[:, :256]), (x[:, 256:], w[:, 256:])]
    fp32_partials = sum(_fp32_product(a, b) for a, b in halves).bfloat16()
    bf16_partials = sum(F.linear(a, b) for a, b in halves)
    assert (fp32_partials == one_process).float().mean() > 0.999
    assert (bf16_partials == one_process).float().mean() < 0.7


def torchrun_train(model_dir: str, out, *overrides: str, processes: int = 2) -> None:
    """`unison train` on ``processes`` torchrun processes (``peers/train_peer.py``); fails with the run's output."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
                           f"--master-port={free_port()}", os.path.join(PEERS, "train_peer.py"), model_dir, str(out),
                           *overrides],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


TP_RUN = ("--dist.tp=2", "--max_steps=2", "--save_every=1")


@pytest.fixture(scope="module")
def tp_run(qwen3_dir, tmp_path_factory):
    """`unison train --dist.tp=2` for 2 steps, saving after each: its output folder (checked by two tests)."""
    out = tmp_path_factory.mktemp("tp_run") / "run"
    torchrun_train(qwen3_dir, out, *TP_RUN)
    return out


def test_torchrun_train_with_tensor_parallelism(qwen3_dir, tp_run, tmp_path):
    out = tp_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["optim/changed_frac"] > 0 for r in records)
    saved = AutoModelForCausalLM.from_pretrained(out / "checkpoint")  # whole weights, loadable without unison
    start = AutoModelForCausalLM.from_pretrained(qwen3_dir)
    assert {k: v.shape for k, v in saved.state_dict().items()} == {k: v.shape for k, v in start.state_dict().items()}
    assert any(not torch.equal(v, start.state_dict()[k]) for k, v in saved.state_dict().items())
    # Each rank saved the optimizer state of its shards; a resumed job continues from them.
    resumed = tmp_path / "resumed"
    torchrun_train(qwen3_dir, resumed, "--dist.tp=2", "--max_steps=2", f"--resume={out / 'checkpoint-1'}")
    assert [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()] == [2]


def test_tensor_parallel_activation_checkpointing_changes_nothing(qwen3_dir, tp_run, tmp_path):
    """Checkpointed layers recompute their forward, collectives included, inside the backward: the same update as
    the plain run (``tp_run``: activation checkpointing off, the default)."""
    assert not load_config(TrainConfig, str(tp_run / "config.yaml")).memory.activation_checkpointing
    torchrun_train(qwen3_dir, tmp_path / "checkpointed", *TP_RUN, "--memory.activation_checkpointing=true")
    checkpointed = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpointed" / "checkpoint").state_dict()
    plain = AutoModelForCausalLM.from_pretrained(tp_run / "checkpoint").state_dict()
    start = AutoModelForCausalLM.from_pretrained(qwen3_dir).state_dict()
    assert any(not torch.equal(v, start[k]) for k, v in plain.items())
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, rtol=0, atol=1e-6, msg=name)


def test_data_parallel_replicas_of_tensor_parallel_groups(qwen3_dir, tmp_path):
    """4 processes as dp=2 x tp=2 make the update that 2 data-parallel replicas of the whole model make: the same
    rollouts (each replica's seed is the run's plus its dp rank) and the same summed gradient; with the optimizer
    state in host memory, exactly the same update."""
    torchrun_train(qwen3_dir, tmp_path / "dp2tp2", "--dist.tp=2", "--max_steps=2", processes=4)
    torchrun_train(qwen3_dir, tmp_path / "dp2tp2_host", "--dist.tp=2", "--max_steps=2", "--optim.placement=host",
                   processes=4)
    torchrun_train(qwen3_dir, tmp_path / "dp2", "--max_steps=2", processes=2)
    runs = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in ("dp2tp2", "dp2")}
    for a, b in zip(runs["dp2tp2"], runs["dp2"], strict=True):
        assert a["reward/mean"] == b["reward/mean"] and a["train/tokens"] == b["train/tokens"]
    sharded = AutoModelForCausalLM.from_pretrained(tmp_path / "dp2tp2" / "checkpoint").state_dict()
    for name, value in AutoModelForCausalLM.from_pretrained(tmp_path / "dp2" / "checkpoint").state_dict().items():
        torch.testing.assert_close(sharded[name], value, rtol=0, atol=1e-4, msg=name)  # 0.1 x lr, as above
    host = AutoModelForCausalLM.from_pretrained(tmp_path / "dp2tp2_host" / "checkpoint").state_dict()
    assert all(torch.equal(host[name], value) for name, value in sharded.items())
    # The optimizer state is split across the replicas: global ranks t and t + 2 (tp rank t of replicas 0 and 1)
    # hold the masters and moments of disjoint parameters that together cover all of them.
    states = [load_trainer_state(str(tmp_path / "dp2tp2" / "checkpoint"), r)["optimizer"]["state"] for r in range(4)]
    for t in range(2):
        held = [{n for n, v in states[r].items() if v is not None} for r in (t, t + 2)]
        assert held[0] and held[1] and not held[0] & held[1] and held[0] | held[1] == set(states[t])


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_plans_unison_cannot_shard_are_refused_by_name(family):
    """MoE experts, MLA's fused projections and vocabulary-sharded embeddings are not sharded by unison's tensor
    parallelism: parallelize refuses the model before touching a device mesh, naming the styles and what to use."""
    import transformers

    from unison.dist.tensor_parallel import parallelize

    config = {"qwen3_moe": "Qwen3MoeConfig", "deepseek_v3": "DeepseekV3Config", "gpt_oss": "GptOssConfig"}[family]
    cfg = getattr(transformers, config)(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=rf"{family}: its tensor-parallel plan .*dist.tp=1"):
        parallelize(model, mesh=None)
