"""Tiny real tokenizers and GGUF files built in the tests: a byte-level BPE tokenizer trained on a few lines, and the
tiny Llama written as a GGUF file with the ``gguf`` package (what a hand-converted model looks like)."""

from __future__ import annotations

import json

import numpy as np
from conftest import tiny_llama


def bpe_tokenizer(special_tokens=("<eos>",)):
    """A real byte-level BPE tokenizer trained here (multi-byte characters span several tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the answer is 42.\n\nThe end", "café au lait, crème brûlée", "so the answer is: yes"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=list(special_tokens),
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def permute(w, n_head):
    """llama.cpp's q/k row order (transformers' GGUF reader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path):
    """The tiny Llama and a byte-level BPE tokenizer with Gemma's turn tokens (no chat template) written as an F32
    GGUF the way llama.cpp's converter writes one (q/k rows permuted). Returns (model, tokenizer)."""
    import gguf

    tok = bpe_tokenizer(("<eos>", "<start_of_turn>", "<end_of_turn>"))
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    merges = spec["model"]["merges"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    for added in spec["added_tokens"]:
        assert tokens[added["id"]] == added["content"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    model = tiny_llama(vocab=len(tokens))
    c = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab["<eos>"])
    w.add_bos_token_id(vocab["<eos>"])
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
           "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for k, v in sd.items():
        if k in names:
            name = names[k]
        else:
            _, _, i, *rest = k.split(".")
            name = f"blk.{i}.{per['.'.join(rest[:-1])]}.weight"
            if rest[-2] in ("q_proj", "k_proj"):
                v = permute(v, c.num_attention_heads if rest[-2] == "q_proj" else c.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(v))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model, tok
