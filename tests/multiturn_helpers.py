"""What the multi-turn tests share: a real byte-level tokenizer with ChatML (every text round-trips exactly, as with
the default model's), and an engine whose model turns are scripted while everything else (KV, continuation,
logprobs of the scripted tokens under the model) is the real engine's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from conftest import tiny_llama

from unison.engine import Engine, EngineConfig

# SmolLM2-135M-Instruct's template (plain ChatML: no tools argument, tool replies as role "tool")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIALS = ["<|im_start|>", "<|im_end|>", "<pad>"]
# Whole strings of the scripted tool calls as single (non-special) tokens: a call decodes in ~5 steps, not ~70.
WORDS = ["<tool_call>", "</tool_call>", '{"name": "guess", "arguments": {"number": ', "}}", "Found it."]
VOCAB = 256 + len(SPECIALS) + len(WORDS)
IM_END = 257


def byte_tokenizer():
    """Byte-level BPE without merges: one token per byte (ids 0-255), then <|im_start|>, <|im_end|>, <pad>, then
    ``WORDS``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's byte -> printable character map, in byte order
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    chars = dict(zip(bs, (chr(c) for c in cs), strict=True))
    assert set(chars.values()) == set(byte_chars)
    vocab = {chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in WORDS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<pad>")
    fast.chat_template = CHATML_TEMPLATE
    return fast


@pytest.fixture(autouse=True)
def one_thread():
    """These tests step the engine hundreds of times on tiny tensors: one thread is ~6x faster than two on a
    loaded CPU (15 ms a step instead of 97, measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ScriptedEngine(Engine):
    """The real engine; only the choice of each sampled token is the script's: ``script(request, context_text)``
    returns the turn's text (ending in <|im_end|>) for a request whose context decodes to ``context_text``. Each
    scripted token's logprob is the model's, under the request's temperature."""

    def __init__(self, tokenizer, script: Callable, config: EngineConfig | None = None, model=None):
        super().__init__(model or tiny_llama(vocab=VOCAB, max_pos=4096),
                         config or EngineConfig(num_blocks=512, block_size=8))
        self.tokenizer, self.script = tokenizer, script
        self.turns: dict[tuple[str, int], list[int]] = {}

    def _sample(self, logits, reqs):
        tokens, logprobs = [], []
        for row, req in zip(logits, reqs, strict=True):
            key = (req.request_id, len(req.prompt))
            if key not in self.turns:
                text = self.script(req, self.tokenizer.decode(req.prompt, skip_special_tokens=False))
                self.turns[key] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            turn = self.turns[key]
            token = turn[len(req.output)] if len(req.output) < len(turn) else IM_END
            t = req.params.temperature or 1.0
            tokens.append(token)
            logprobs.append(torch.log_softmax(row.float() / t, dim=-1)[token])
        return torch.tensor(tokens), torch.stack(logprobs)
