"""`unison train` end to end on a tiny model saved as a local HF folder: the run directory, lr 0 agreement."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_llama

from unison.config import load_config
from unison.tasks import Task
from unison.train.config import TrainConfig
from unison.train.loop import train


def count_w7(prompts, completions, **_):
    return [c.split().count("w7") + 0.01 * len(c.split()) for c in completions]


def task():
    rows = [{"prompt": " ".join(f"w{3 + (i * 11 + j) % 250}" for j in range(4 + i % 5)), "answer": "w7"}
            for i in range(20)]
    return Task("tiny", rows, [(count_w7, 1.0)])


def run_cfg(model_dir, out, *overrides):
    return load_config(TrainConfig, None, [
        f"--output_dir={out}", f"--model.name_or_path={model_dir}", "--max_steps=3", "--rollout.group_size=4",
        "--rollout.samples_per_step=8", "--rollout.max_concurrent_rollouts=16", "--rollout.max_new_tokens=12",
        "--engine.num_blocks=256", "--engine.block_size=8", "--step.max_tokens_per_row=64", *overrides])


@pytest.fixture(scope="module")
def default_run(model_dir, tmp_path_factory):
    """One run of the default settings at lr 1e-3 (on the CPU the KV pool is not lent): its output folder and last
    metrics, checked by two tests."""
    out = tmp_path_factory.mktemp("default") / "run"
    return out, train(run_cfg(model_dir, out, "--optim.lr=1e-3"), task())


def test_run_directory_and_checkpoint(model_dir, default_run):
    out, last = default_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("reward/mean", "time/step_s", "is/clipfrac", "mismatch/logprob_diff_mean", "loss"):
        assert all(r[key] is not None for r in records), key
    assert last["optim/changed_frac"] > 0
    assert (out / "curves.png").stat().st_size > 1000
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(out))
    resolved = load_config(TrainConfig, str(out / "config.yaml"))
    assert resolved.optim.lr == 1e-3 and resolved.rollout.group_size == 4
    # The checkpoint loads in plain transformers (no unison import) and holds the trained weights.
    probe = ("import sys, torch; from transformers import AutoModelForCausalLM; "
             "m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); "
             "print(m.model.embed_tokens.weight.double().sum().item())")
    got = subprocess.run([sys.executable, "-c", probe, str(out / "checkpoint")], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": ""})
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_dir).model.embed_tokens.weight.double().sum().item()
    assert float(got.stdout.split()[-1]) != pytest.approx(start, abs=1e-9)


def test_engine_and_trainer_agree_at_lr_zero(model_dir, tmp_path):
    train(run_cfg(model_dir, tmp_path / "lr0", "--optim.lr=0.0", "--max_steps=3"), task())
    records = [json.loads(line) for line in (tmp_path / "lr0" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert r["mismatch/logprob_diff_mean"] < 1e-5  # fp32: engine and trainer compute the same function
        assert r["mismatch/logprob_diff_max"] < 1e-4
        assert r["is/clipfrac"] == 0 and r["is/dropped_frac"] == 0
        assert r["optim/changed_frac"] == 0


@pytest.mark.parametrize("frozen_before", [False, True], ids=["nothing-frozen", "some-frozen-before"])
def test_the_heap_is_frozen_after_the_first_step_and_thawed_at_the_end(model_dir, tmp_path, frozen_before):
    """From the second rollout on, the first step's survivors are out of the garbage collector's walks, also where
    something froze a few objects before the run (the H200 host's Python had); after the run nothing stays frozen
    (a sweep in one process keeps no earlier run's heap)."""
    import gc

    seen = []

    def judge(prompts, completions, **_):
        seen.append(gc.get_freeze_count())
        return [float("w7" in c) for c in completions]

    assert gc.get_freeze_count() == 0
    if frozen_before:
        gc.freeze()  # everything alive now: the test session's heap
    before = gc.get_freeze_count()
    train(run_cfg(model_dir, tmp_path / "run", "--max_steps=2"), Task("tiny", task().rows, [(judge, 1.0)]))
    # Frozen from the second rollout on: the run's model, tokenizer and modules (over 10k objects; with the session's
    # heap frozen before, which held much of what the run imports, at least the run's own model). Without the
    # run's freeze the count could only fall: frozen objects that die leave it.
    assert seen[0] <= before and seen[-1] > seen[0] + (100 if frozen_before else 10_000)
    assert gc.get_freeze_count() == 0


def test_bad_inputs_have_clear_errors(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        train(run_cfg(str(tmp_path / "does-not-exist"), tmp_path / "x"), task())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        train(run_cfg(model_dir, tmp_path / "y", f"--data.source={empty}"))
    with pytest.raises(ValueError, match="multiple of group_size"):
        run_cfg(model_dir, tmp_path / "z", "--rollout.samples_per_step=6")


def test_sdpa_model_is_refused_for_packed_training():
    from transformers import LlamaForCausalLM

    from unison.train.leak import check_packed_attention

    model = tiny_llama()
    sdpa = LlamaForCausalLM._from_config(type(model.config)(**model.config.to_dict()), attn_implementation="sdpa")
    with pytest.raises(ValueError, match="attend to each other"):
        check_packed_attention(sdpa)
    check_packed_attention(model)
    torch.testing.assert_close(sdpa.model.embed_tokens.weight.shape, model.model.embed_tokens.weight.shape)


def test_lending_host_placement_and_checkpointing_change_nothing(model_dir, default_run, tmp_path):
    """Same seed, same run: with the KV pool lent to every step or not, the optimizer state in
    host memory or not, activation checkpointing or not: the same completions, losses and final weights."""
    from safetensors.torch import load_file

    runs = {"lending": ["--memory.lend_kv=always"], "no_lending": None,  # default_run: not lent on the CPU
            "host": ["--optim.placement=host"], "checkpointing": ["--memory.activation_checkpointing=true"]}
    results = {}
    for name, overrides in runs.items():
        out = default_run[0] if overrides is None else tmp_path / name
        if overrides is not None:
            train(run_cfg(model_dir, out, "--optim.lr=1e-3", *overrides), task())
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        results[name] = (records, load_file(str(out / "checkpoint" / "model.safetensors")))
    base_records, base_weights = results.pop("lending")
    assert all(r["memory/kv_lent_gib"] > 0 for r in base_records)
    for name, (records, weights) in results.items():
        for a, b in zip(base_records, records, strict=True):
            assert a["reward/mean"] == b["reward/mean"], name
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7), name
        for key, tensor in base_weights.items():
            torch.testing.assert_close(weights[key], tensor, rtol=1e-5, atol=1e-6, msg=f"{name}: {key}")
    assert all(r["memory/kv_lent_gib"] == 0 for r in results["no_lending"][0])


def test_resume_continues_from_the_saved_state(model_dir, tmp_path):
    from safetensors.torch import load_file

    first = tmp_path / "first"
    common = ("--optim.lr=1e-3", "--optim.schedule=cosine", "--max_steps=4")
    train(run_cfg(model_dir, first, *common, "--save_every=2"), task())
    ckpt = first / "checkpoint-2"
    saved = torch.load(ckpt / "trainer_state-rank0.pt", weights_only=False)
    assert saved["step"] == 2 and saved["optimizer"]["step_count"] == 2

    # Resuming at the saved step itself runs nothing: the state must come back out exactly as it went in.
    same = tmp_path / "same"
    train(run_cfg(model_dir, same, "--optim.lr=1e-3", "--optim.schedule=cosine", "--max_steps=2",
                  f"--resume={ckpt}"), task())
    again = torch.load(same / "checkpoint" / "trainer_state-rank0.pt", weights_only=False)
    for name, tensors in saved["optimizer"]["state"].items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, again["optimizer"]["state"][name], strict=True))
    assert again["rollout"]["order"] == saved["rollout"]["order"]
    weights, saved_weights = load_file(str(same / "checkpoint" / "model.safetensors")), \
        load_file(str(ckpt / "model.safetensors"))
    assert all(torch.equal(weights[k], v) for k, v in saved_weights.items())

    # Resuming to the end continues the step count and the lr schedule where they were.
    resumed = tmp_path / "resumed"
    train(run_cfg(model_dir, resumed, *common, f"--resume={ckpt}"), task())
    records = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    original = [json.loads(line) for line in (first / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 4]
    assert [r["optim/lr"] for r in records] == [r["optim/lr"] for r in original[2:]]
    with pytest.raises(FileNotFoundError, match="trainer state"):
        train(run_cfg(model_dir, tmp_path / "bad", *common, f"--resume={model_dir}"), task())


def test_rows_shorter_than_prompt_plus_completion(model_dir, tmp_path):
    """An explicit ``step.max_tokens_per_row`` below the longest prompt plus ``max_new_tokens`` cuts those
    completions to fit (they used to stop the run at the first training step with a packing error)."""
    out = tmp_path / "run"
    last = train(run_cfg(model_dir, out, "--optim.lr=1e-3", "--max_steps=2", "--step.max_tokens_per_row=14"), task())
    assert last["train/loss_tokens"] > 0 and last["completion/truncated_frac"] > 0
