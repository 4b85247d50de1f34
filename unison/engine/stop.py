"""Stop strings: found in a request's decoded output as each token lands, and cut from its text.

The engine samples tokens, the stop strings are text. After each new token the engine decodes only the last few
output tokens (a string of B UTF-8 bytes spans at most B tokens, since every token but a skipped special one
decodes to at least one byte; one more token absorbs what decoding mid-text does at the window's left edge, such as
SentencePiece dropping a leading space), so the check costs the same at token 10 and token 10,000. Being checked
after every token, the first window that holds a stop string holds its first occurrence.

What comes back is consistent with what the engine sampled: ``Completion.token_ids`` run through the token that
completes the stop string (it was sampled, its logprob is the sampling distribution's, and the trainer trains on
it); ``completion_text`` is the decoded text cut before the stop string (vLLM's default: the stop string, and any
characters of that last token after it, are not in the text).

>>> engine = Engine(model, tokenizer=tokenizer)                                # doctest: +SKIP
>>> done = engine.generate([ids], SamplingParams(stop=("\\n\\n",)))[0]        # doctest: +SKIP
>>> completion_text(tokenizer, done)                                           # doctest: +SKIP
'the first paragraph'
"""

from __future__ import annotations

from collections.abc import Callable

from .types import Completion

DECODE = {"skip_special_tokens": True}
"""How output tokens become text, for stop strings and rewards alike (the rollout loop decodes with the same)."""


def decoder(tokenizer) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, **DECODE)``. For a fast tokenizer that decodes through transformers' own
    ``TokenizersBackend`` (no override in its class or on the instance) and cleans up no spaces: its Rust
    tokenizer's ``decode``, the call transformers makes then, without transformers' type check of every id first
    (``to_py_obj``: two thirds of the time landing 64 completions of 512 tokens took, 17-22 ms on a CI core)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and _decodes_as_its_backend(tokenizer):
        decode = backend.decode
        return lambda ids: decode(list(ids), skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, **DECODE)


def _decodes_as_its_backend(tokenizer) -> bool:
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # (another transformers layout: the tokenizer's own decode)
        return False
    cls, own = type(tokenizer), vars(tokenizer)
    return (isinstance(tokenizer, TokenizersBackend) and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is TokenizersBackend._decode and "decode" not in own and "_decode" not in own
            and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False)


class StopStrings:
    """``find(output, stops)``: the stop string that the last token completed, or None."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decode = decoder(tokenizer)  # (after every token of every request with stop strings: made once)

    def find(self, output: list[int], stops: tuple[str, ...]) -> str | None:
        window = max(len(s.encode()) for s in stops) + 2
        text = self.decode(output[-window:])
        found = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
        return stops[min(found)[1]] if found else None  # the one that starts first, then the first listed


def completion_text(tokenizer, completion: Completion) -> str:
    """The completion's text, cut before its stop string where one ended it."""
    return completion_texts(tokenizer, [completion])[0]


def completion_texts(tokenizer, completions: list[Completion]) -> list[str]:
    """``completion_text`` of each, through one ``decoder``."""
    decode, texts = decoder(tokenizer), []
    for completion in completions:
        text = decode(completion.token_ids)
        if completion.stop_string is not None:
            cut = text.find(completion.stop_string)
            if cut >= 0:
                text = text[:cut]
        texts.append(text)
    return texts
