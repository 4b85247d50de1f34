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

from .types import Completion

DECODE = {"skip_special_tokens": True}
"""How output tokens become text, for stop strings and rewards alike (the rollout loop decodes with the same)."""


class StopStrings:
    """``find(output, stops)``: the stop string that the last token completed, or None."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def find(self, output: list[int], stops: tuple[str, ...]) -> str | None:
        window = max(len(s.encode()) for s in stops) + 2
        text = self.tokenizer.decode(output[-window:], **DECODE)
        found = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
        return stops[min(found)[1]] if found else None  # the one that starts first, then the first listed


def completion_text(tokenizer, completion: Completion) -> str:
    """The completion's text, cut before its stop string where one ended it."""
    text = tokenizer.decode(completion.token_ids, **DECODE)
    if completion.stop_string is not None:
        cut = text.find(completion.stop_string)
        if cut >= 0:
            text = text[:cut]
    return text
