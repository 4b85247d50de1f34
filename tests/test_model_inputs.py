"""Model inputs: the family's chat template where a tokenizer has none, a clear error where no family fits, the
turn-end token read off the template (Gemma's <end_of_turn>, GLM's <|user|>) stopping completions, .gguf paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import tiny_llama, tiny_tokenizer
from tiny_gguf import write_tiny_gguf

from unison.chat_templates import family_template, turn_end_ids
from unison.config import InvalidInputError
from unison.engine import Engine, EngineConfig, SamplingParams
from unison.models import cache_dir, load_policy, resolve_model, stop_token_ids
from unison.rollout.loop import encode_prompt


def family_tokenizer(*specials: str, vocab: int = 256):
    """The tiny word-level tokenizer (ids 0-2 <pad> <unk> <eos>, then words) with a family's special tokens last,
    no chat template: ``vocab`` ids in all (the tiny models' vocabulary)."""
    tok = tiny_tokenizer(vocab - len(specials))
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    return tok


def test_gemma_tokenizer_gets_its_template_and_ends_turns_on_end_of_turn():
    tok = family_tokenizer("<bos>", "<start_of_turn>", "<end_of_turn>")
    assert not tok.chat_template
    name, template = family_template(tok)
    tok.chat_template = template
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    assert name == "Gemma" and eot == 255
    text = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "w5"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.endswith("<start_of_turn>user\nbe brief\n\nw5<end_of_turn>\n<start_of_turn>model\n")
    assert turn_end_ids(tok) == [eot]
    ids = stop_token_ids(tok, tiny_llama())
    assert eot in ids and tok.eos_token_id in ids


def test_glm_template_ends_a_turn_where_the_next_user_turn_opens():
    tok = family_tokenizer("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>")
    name, tok.chat_template = family_template(tok)
    assert name == "GLM-4" and turn_end_ids(tok) == [tok.convert_tokens_to_ids("<|user|>")]


def test_template_without_a_special_turn_end_adds_no_stop():
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    assert turn_end_ids(tok) == []


def test_sampling_stops_at_the_gemma_turn_end_token():
    """Sampled with the derived stop ids, a completion ends at the first <end_of_turn> (never runs past one)."""
    # A 32-token vocabulary: a random model emits <end_of_turn> in a few of 8 samples of 16 tokens.
    tok, model = family_tokenizer("<bos>", "<start_of_turn>", "<end_of_turn>", vocab=32), tiny_llama(vocab=32)
    tok.chat_template = family_template(tok)[1]
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    stops = stop_token_ids(tok, model)
    engine = Engine(model, EngineConfig(num_blocks=128, block_size=16, seed=0))
    prompt = encode_prompt(tok, "w5 w6")
    assert eot == 31 and eot in stops
    done = engine.generate([prompt], SamplingParams(max_new_tokens=16, n=8, seed=1, stop_token_ids=tuple(stops)))
    at_eot = [c for c in done if c.token_ids[-1] == eot]
    assert at_eot and all(c.finish_reason == "stop" for c in at_eot)
    assert all(eot not in c.token_ids[:-1] for c in done)
    assert all(c.finish_reason == "length" or c.token_ids[-1] in stops for c in done)
    # Without the template's turn end, the same samples run past it.
    plain = engine.generate([prompt], SamplingParams(max_new_tokens=16, n=8, seed=1,
                                                     stop_token_ids=(tok.eos_token_id,)))
    assert any(eot in c.token_ids[:-1] for c in plain)


def save_tiny(path, chat_template: str | None = None):
    tok = tiny_tokenizer()
    if chat_template:
        tok.chat_template = chat_template
    tiny_llama().save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_tokenizer_without_template_or_family_is_a_clear_error(tmp_path):
    folder = save_tiny(tmp_path / "m")
    with pytest.raises(InvalidInputError, match=r"no chat template.*model\.chat_template"):
        load_policy(folder)
    template_file = tmp_path / "chat.jinja"
    template_file.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    _, tok = load_policy(folder, chat_template=str(template_file))
    assert tok.apply_chat_template([{"role": "user", "content": "w7"}], tokenize=False) == "w7 "
    with pytest.raises(FileNotFoundError, match="model.chat_template"):
        load_policy(folder, chat_template=str(tmp_path / "missing.jinja"))


def test_a_gguf_path_converts_once_with_its_family_template_and_turn_end(tmp_path, monkeypatch):
    """A hand-converted-style GGUF (tiny Llama, BPE tokenizer with Gemma's turn tokens, no chat template) given as
    model.name_or_path: converted once into the cache with the model's exact logits, loaded with the Gemma
    template, <end_of_turn> among the stop ids; a changed file converts again."""
    pytest.importorskip("gguf")
    monkeypatch.setenv("UNISON_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-gemma-style.gguf"
    source, source_tok = write_tiny_gguf(path)
    model, tok = load_policy(str(path))
    folder, _ = resolve_model(str(path))
    assert folder.startswith(str(cache_dir() / "gguf" / "tiny-gemma-style-"))
    ids = torch.tensor([[5, 9, 30, 77, 120]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=0, atol=1e-5)
    text = "café au lait, 42"
    assert tok(text)["input_ids"] == source_tok(text)["input_ids"]
    assert family_template(tok)[0] == "Gemma" and tok.chat_template == family_template(tok)[1]
    assert tok.convert_tokens_to_ids("<end_of_turn>") in stop_token_ids(tok, model)
    stamp = (Path(folder) / "model.safetensors").stat().st_mtime_ns
    load_policy(str(path))
    assert (Path(folder) / "model.safetensors").stat().st_mtime_ns == stamp  # converted once
    write_tiny_gguf(path)
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))
    assert resolve_model(str(path))[0] != folder


def test_a_bad_gguf_or_another_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("UNISON_CACHE", str(tmp_path / "cache"))
    not_gguf = tmp_path / "broken.gguf"
    not_gguf.write_bytes(b"not a gguf file")
    with pytest.raises(InvalidInputError, match="broken.gguf"):
        resolve_model(str(not_gguf))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(InvalidInputError, match=r"not a \.gguf"):
        resolve_model(str(other))


def test_a_saved_gemma_folder_loads_with_its_template_and_turn_end(tmp_path):
    """A model folder whose tokenizer has the Gemma tokens and no template loads with the Gemma template, and
    stop_token_ids (what `unison train` hands the rollout) holds <end_of_turn>."""
    tok = family_tokenizer("<bos>", "<start_of_turn>", "<end_of_turn>")
    tiny_llama().save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, loaded = load_policy(str(tmp_path))
    assert loaded.chat_template == family_template(loaded)[1]
    assert loaded.convert_tokens_to_ids("<end_of_turn>") in stop_token_ids(loaded, model)
    assert loaded.convert_tokens_to_ids("<start_of_turn>") in encode_prompt(loaded, "w9")[-3:]
