import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import unison.engine.attention  # noqa: F401  registers attn_implementation="unison"
from unison.train.checkpoint import save_hf_checkpoint, save_trainer_state

WORDS = "the cat sat on a mat and ate fish".split()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM._from_config(config, attn_implementation="unison").eval()


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"[UNK]": 0, "[PAD]": 1, "[EOS]": 2} | {w: i + 3 for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")


# Runs in a fresh interpreter that never imports unison: what a user's eval script or another library sees.
LOADER = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    out = {}
    for path in sys.argv[1:-1]:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok("the cat sat on a mat", return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        out[path] = {"ids": ids[0].tolist(), "logits": logits[0].tolist(), "tied": emb.data_ptr() == head.data_ptr(),
                     "attn": model.config._attn_implementation, "eos": tok.eos_token}
    assert not any(name.split(".")[0] == "unison" for name in sys.modules), "loader imported unison"
    with open(sys.argv[-1], "w") as f:
        json.dump(out, f)
""")


def test_loads_in_plain_transformers_with_equal_logits(model, tokenizer, tmp_path):
    plain = save_hf_checkpoint(model, tokenizer, str(tmp_path / "plain"))
    # Some code paths (and transformers versions) serialise the implementation name: it must not survive.
    model.config.attn_implementation = "unison"
    try:
        forced = save_hf_checkpoint(model, tokenizer, str(tmp_path / "forced"))
    finally:
        del model.config.attn_implementation
    for path in (plain, forced):
        assert "unison" not in (tmp_path / path / "config.json").read_text()
        with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
            assert "model.embed_tokens.weight" in f.keys() and "lm_head.weight" not in f.keys()  # stored once

    result_path = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-c", LOADER, plain, forced, str(result_path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(result_path.read_text())

    ids = tokenizer("the cat sat on a mat", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = model(ids).logits[0]
    for path in (plain, forced):
        got = results[path]
        assert got["ids"] == ids[0].tolist() and got["eos"] == "[EOS]"
        assert got["tied"] and got["attn"] != "unison"
        torch.testing.assert_close(torch.tensor(got["logits"]), expected, rtol=1e-5, atol=1e-5)


def test_overwrite_replaces_whole_checkpoint_and_leaves_no_temp(model, tokenizer, tmp_path):
    path = str(tmp_path / "ckpt")
    save_hf_checkpoint(model, tokenizer, path)
    (tmp_path / "ckpt" / "stale.txt").write_text("from the old checkpoint")
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    try:
        save_hf_checkpoint(model, None, path)
    finally:
        with torch.no_grad():
            model.model.norm.weight.sub_(1.0)
    assert os.listdir(tmp_path) == ["ckpt"]
    assert not (tmp_path / "ckpt" / "stale.txt").exists() and not (tmp_path / "ckpt" / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(path)
    torch.testing.assert_close(loaded.model.norm.weight, model.model.norm.weight + 1.0)


def test_failed_save_keeps_old_checkpoint(model, tokenizer, tmp_path):
    path = tmp_path / "ckpt"
    save_hf_checkpoint(model, tokenizer, str(path))
    before = {name: (path / name).read_bytes() for name in os.listdir(path)}
    with pytest.raises(AttributeError):
        save_hf_checkpoint(model, object(), str(path))  # not a tokenizer: fails after the weights are written
    assert os.listdir(tmp_path) == ["ckpt"]
    assert {name: (path / name).read_bytes() for name in os.listdir(path)} == before


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_checkpoints_get_the_permissions_the_umask_gives(umask, model, tokenizer, tmp_path):
    """Like any HF save: folders 0o777 and files 0o666 less the umask (temporary names made them 0700 / 0600)."""
    old = os.umask(umask)
    try:
        path = save_hf_checkpoint(model, tokenizer, str(tmp_path / "ckpt"))
        save_trainer_state(path, 0, {"step": 1})
        save_hf_checkpoint(model, tokenizer, path)  # replacing a checkpoint: the same again
        save_trainer_state(path, 0, {"step": 2})
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o777 & ~umask
    for name in os.listdir(path):
        assert os.stat(os.path.join(path, name)).st_mode & 0o777 == 0o666 & ~umask, name
    assert "trainer_state-rank0.pt" in os.listdir(path)
