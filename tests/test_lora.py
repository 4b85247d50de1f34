"""LoRA adapters through PEFT: the engine decodes through them exactly, only they train and sync, PEFT loads them."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer

import pytest
import torch
from conftest import max_logprob_diff, random_prompts, teacher_forced_logprobs, tiny_llama
from test_train_e2e import run_cfg, task

from unison.config import ConfigError
from unison.engine import Engine, EngineConfig, SamplingParams
from unison.lora import LoraConfig, adapters_disabled, apply_lora, merged_state_dict, save_adapter, synced_params
from unison.serve import GenerationServer, make_handler
from unison.sync import Receiver, anchor_patch, checksum, encode, sparse_patch
from unison.train.optimizer import MasterAdamW, OptimConfig

peft = pytest.importorskip("peft")
NO_STOP = ()


def lora_llama(seed: int = 0, r: int = 4, dtype=torch.float32, targets=("all-linear",), lora_seed: int = 0):
    """The tiny Llama with adapters on ``targets``, lora_B random (as after training) so that they matter."""
    model = tiny_llama(seed=seed, dtype=dtype)
    torch.manual_seed(lora_seed)
    apply_lora(model, LoraConfig(r=r, alpha=2 * r, target_modules=list(targets)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return model


def peft_reference(folder: str, seed: int = 0):
    """The PEFT model of the saved adapters on a fresh copy of the base, with transformers' eager attention."""
    base = tiny_llama(seed=seed)
    base.config._attn_implementation = "eager"
    return peft.PeftModel.from_pretrained(base, folder).eval()


def test_engine_logprobs_equal_the_peft_models_forward(tmp_path):
    model = lora_llama()
    engine = Engine(model, EngineConfig(num_blocks=128, block_size=4, seed=0))
    params = SamplingParams(max_new_tokens=16, temperature=1.0, n=2, stop_token_ids=NO_STOP)
    done = engine.generate(random_prompts([5, 12, 3]), params)
    save_adapter(model, LoraConfig(r=4, alpha=8), str(tmp_path), "tiny")
    reference = peft_reference(str(tmp_path))
    assert max_logprob_diff(reference, done) < 1e-4
    with reference.disable_adapter():  # the adapters matter: the base alone is far off
        assert max_logprob_diff(reference, done) > 1e-2

    # The engine reads the very adapter tensors the optimizer writes: after a step, no merge, no copy.
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=1e-2), total_steps=2)
    assert all("lora_" in name for name in opt.params)
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    opt.step()
    engine.weights_updated(1)
    done = engine.generate(random_prompts([7, 4], seed=1), params)
    save_adapter(model, LoraConfig(r=4, alpha=8), str(tmp_path), "tiny")
    assert max_logprob_diff(peft_reference(str(tmp_path)), done) < 1e-4


def test_merged_engine_weights_follow_the_adapters(tmp_path):
    """engine.lora_weights=merged: the engine decodes from W + s B A copies, refreshed at every weight update."""
    model = lora_llama()
    engine = Engine(model, EngineConfig(num_blocks=128, block_size=4, seed=0, lora_weights="merged"))
    adapted = [m for m in model.modules() if hasattr(m, "lora_A")]
    assert engine.lora_merged.nbytes == sum(m.get_base_layer().weight.numel() * 4 for m in adapted)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, stop_token_ids=NO_STOP)
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=1e-2), total_steps=2)
    for version in (0, 1):
        done = engine.generate(random_prompts([5, 9], seed=version), params)
        save_adapter(model, LoraConfig(r=4, alpha=8), str(tmp_path), "tiny")
        assert max_logprob_diff(peft_reference(str(tmp_path)), done) < 1e-4, version
        ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(version))
        model(ids, labels=ids).loss.backward()  # the training forward: PEFT's unmerged layers
        assert opt.step().changed_fraction > 0
        opt.zero_grad()
        engine.weights_updated(version + 1)


def test_only_adapters_change_and_the_masks_are_exact():
    model = lora_llama(dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = MasterAdamW(model.named_parameters(), OptimConfig(lr=3e-3), total_steps=5)
    for step in range(3):
        ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(step))
        model(ids, labels=ids).loss.backward()
        old = {n: p.detach().clone() for n, p in opt.params.items()}
        opt.step()
        opt.zero_grad()
        assert set(opt.changed_masks) == set(opt.params)
        for name, mask in opt.changed_masks.items():
            assert torch.equal(mask, opt.params[name].detach() != old[name]), name
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == ("lora_" in name), name  # every adapter moved, no base tensor did
    assert all(s.master.dtype == torch.float32 for s in opt.state.values())
    assert sum(p.numel() for p in opt.params.values()) < 0.2 * sum(p.numel() for p in model.parameters())


def test_a_served_receiver_ends_bit_identical_after_adapter_patches():
    trainer = lora_llama(dtype=torch.bfloat16)
    served = lora_llama(dtype=torch.bfloat16, lora_seed=1)  # the same base, other adapters until the anchor
    base_before = {n: p.detach().clone() for n, p in served.named_parameters() if "lora_" not in n}
    params = synced_params(trainer)
    assert params and all("lora_" in n for n in params)
    receiver = Receiver(synced_params(served))
    anchor = anchor_patch(params, version=0)
    assert set(anchor.values) == set(params)  # the anchor carries the adapters alone
    assert receiver.receive(encode(anchor))
    opt = MasterAdamW(trainer.named_parameters(), OptimConfig(lr=3e-3), total_steps=10)
    for step in range(1, 6):
        ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(step))
        trainer(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        patch = sparse_patch(params, opt.changed_masks, step - 1, step)
        assert patch.num_elements == sum(int(m.sum()) for m in opt.changed_masks.values())
        assert receiver.receive(encode(patch)), receiver.last_error
    mine = dict(served.named_parameters())
    for name, p in trainer.named_parameters():
        assert torch.equal(p.detach().view(torch.int16), mine[name].detach().view(torch.int16)), name
    assert all(torch.equal(mine[n].detach(), t) for n, t in base_before.items())


def test_reference_is_the_base_and_merged_weights_are_the_policy(tmp_path):
    from transformers import AutoModelForCausalLM

    model = lora_llama()
    base = tiny_llama()
    prompt, tokens = random_prompts([6])[0], random_prompts([9], seed=2)[0]
    with adapters_disabled(model):
        off = teacher_forced_logprobs(model, prompt, tokens)
    assert (off - teacher_forced_logprobs(base, prompt, tokens)).abs().max() < 1e-6
    assert (off - teacher_forced_logprobs(model, prompt, tokens)).abs().max() > 1e-2  # and back on after
    merged = AutoModelForCausalLM.from_config(base.config)
    merged.load_state_dict(merged_state_dict(model))
    merged.config._attn_implementation = "eager"
    assert (teacher_forced_logprobs(merged.eval(), prompt, tokens)
            - teacher_forced_logprobs(model, prompt, tokens)).abs().max() < 1e-4


def test_mla_latent_cache_decodes_through_adapters_on_kv_b_proj():
    """The absorbed attention multiplies by kv_b_proj's weight itself: with an adapter there, W + s B A."""
    from test_mla import tiny_more

    model, eager = tiny_more("youtu")
    for m in (model, eager):
        torch.manual_seed(0)
        apply_lora(m, LoraConfig(r=4, alpha=8, target_modules=["kv_b_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    eager.load_state_dict(model.state_dict())
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4, seed=0, mla_cache="latent", attention="torch"))
    assert engine.pool.has_latent
    done = engine.generate(random_prompts([5, 9]), SamplingParams(max_new_tokens=8, stop_token_ids=NO_STOP))
    assert max_logprob_diff(eager, done) < 1e-4
    with adapters_disabled(eager):
        assert max_logprob_diff(eager, done) > 1e-3


def test_bad_lora_settings_are_refused():
    with pytest.raises(ValueError, match="output head"):
        LoraConfig(r=4, target_modules=["lm_head"])
    with pytest.raises(ValueError, match="lora.r"):
        LoraConfig(r=-1)
    with pytest.raises(ValueError, match="stands alone"):
        LoraConfig(r=4, target_modules=["all-linear", "q_proj"])
    with pytest.raises(ConfigError, match="target_modules"):
        apply_lora(tiny_llama(), LoraConfig(r=4, target_modules=["no_such_proj"]))
    with pytest.raises(ConfigError, match="linear"):
        apply_lora(tiny_llama(), LoraConfig(r=4, target_modules=["embed_tokens"]))


def check_saved_lora(model_dir: str, ckpt) -> dict[str, torch.Size]:
    """PEFT loads a run's saved adapters onto the base, which they changed; its merged folder is the same policy in
    plain transformers. Returns the loaded adapters' shapes (PEFT's names, without the prefix)."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager")
    policy = peft.PeftModel.from_pretrained(base, str(ckpt)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(ckpt / "merged"), attn_implementation="eager").eval()
    prompt, tokens = random_prompts([6])[0], random_prompts([8], seed=3)[0]
    trained = teacher_forced_logprobs(policy, prompt, tokens)
    assert (trained - teacher_forced_logprobs(merged, prompt, tokens)).abs().max() < 1e-4
    with policy.disable_adapter():
        assert (trained - teacher_forced_logprobs(policy, prompt, tokens)).abs().max() > 1e-4  # it trained
    return {n.removeprefix("base_model.model."): p.shape for n, p in policy.named_parameters() if ".lora_" in n}


def test_unison_train_with_lora_saves_peft_adapters_and_resumes(model_dir, tmp_path):
    from safetensors.torch import load_file

    from unison.train.loop import train

    lora = ["--model.lora.r=4", "--model.lora.alpha=8", "--model.lora.save_merged=true", "--optim.lr=1e-2"]
    out = tmp_path / "run"
    last = train(run_cfg(model_dir, out, *lora, "--loss.beta=0.1"), task())
    assert last["optim/changed_frac"] > 0
    ckpt = out / "checkpoint"
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == model_dir
    assert all(k.startswith("base_model.model.") and ".lora_" in k
               for k in load_file(str(ckpt / "adapter_model.safetensors")))
    check_saved_lora(model_dir, ckpt)
    # A resumed run loads the adapters (and their optimizer state) and goes on.
    train(run_cfg(model_dir, tmp_path / "resumed", *lora, "--max_steps=4", f"--resume={ckpt}"), task())
    resumed = load_file(str(tmp_path / "resumed" / "checkpoint" / "adapter_model.safetensors"))
    saved = load_file(str(ckpt / "adapter_model.safetensors"))
    assert set(resumed) == set(saved) and any(not torch.equal(resumed[k], saved[k]) for k in saved)


def test_train_with_lora_through_a_served_process(model_dir, tmp_path):
    """sync.mode=sparse with LoRA: the anchor and every patch carry the adapter elements alone; the server's
    adapters end bit-identical to the trainer's checkpoint."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from unison.train.loop import train

    served = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="unison").eval()
    torch.manual_seed(123)
    apply_lora(served, LoraConfig(r=4, alpha=8))
    receiver = Receiver(synced_params(served))
    server = GenerationServer(Engine(served, EngineConfig(num_blocks=256, block_size=8, seed=0)), receiver)
    server.start()
    http = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(server, timeout=60))
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        out = tmp_path / "run"
        train(run_cfg(model_dir, out, "--model.lora.r=4", "--model.lora.alpha=8", "--optim.lr=1e-2",
                      "--sync.mode=sparse", f"--sync.servers=[http://127.0.0.1:{http.server_address[1]}]"), task())
    finally:
        http.shutdown()
        server.stop()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    adapters = sum(p.numel() for p in receiver.params.values())
    base = sum(p.numel() for n, p in served.named_parameters() if "lora_" not in n)
    # Adapter elements only (value, index and checksums: under 12 bytes each here, fp32), never the base.
    assert all(0 < r["sync/bytes"] < 12 * adapters < base for r in records)
    assert receiver.version == 3 and receiver.counts["rejected"] == 0
    saved = load_file(str(out / "checkpoint" / "adapter_model.safetensors"))
    mine = {n.replace(".default.", "."): p for n, p in served.named_parameters() if "lora_" in n}
    assert all(checksum(mine[k.removeprefix("base_model.model.")]) == checksum(t) for k, t in saved.items())


def test_train_from_an_existing_peft_adapter(model_dir, tmp_path):
    """model.lora.adapter: a PEFT adapter saved by PEFT itself (another run's, an SFT's) is the start: its settings
    and tensors, and the KL reference is the base with it (not the base alone)."""
    from transformers import AutoModelForCausalLM

    from unison.train.loop import train

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(0)
    sft = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in sft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    sft.save_pretrained(tmp_path / "sft")
    cfg = run_cfg(model_dir, tmp_path / "run", f"--model.lora.adapter={tmp_path / 'sft'}", "--loss.beta=0.1",
                  "--optim.lr=0", "--max_steps=1")
    assert (cfg.model.lora.r, cfg.model.lora.alpha, cfg.model.lora.target_modules) == (2, 4.0, ["q_proj", "v_proj"])
    last = train(cfg, task())
    assert last["kl/ref_mean"] < 1e-6  # at lr 0 the policy is its reference: the base with the SFT adapter
    assert last["mismatch/logprob_diff_mean"] < 1e-5  # and the engine decoded through that adapter
    with pytest.raises(ConfigError, match="no readable PEFT adapter config"):
        LoraConfig(adapter=str(tmp_path))
