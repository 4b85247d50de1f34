"""What `unison serve` accepts and writes at its HTTP boundary: a completion request checked field by field, and
strict JSON out.

Every field is checked here, before it reaches the engine thread: a value the engine cannot use (an unhashable
seed, a top_k beyond int64) used to fail inside an engine step, and a failed step fails every request in flight,
other clients' included.

    >>> parse_completion_request(b'{"prompt": [5, 6], "max_tokens": 8, "n": 2}', max_n=256)[1].n
    2

A vision-language server's prompts may hold images: ``images`` lists them as ``data:image/png;base64,...`` URLs
(``unison.vision.images.encode_image``), in the order of the prompt's image placeholders, whose tokens the prompt
already holds expanded (as the model's processor writes them).
    >>> parse_completion_request(b'{"prompt": [5], "max_tokens": 3.5}', max_n=256)
    Traceback (most recent call last):
    ...
    unison.serve_request.RequestError: max_tokens must be an int >= 1, at most 2**63 - 1, got 3.5
"""

from __future__ import annotations

import json
import math
from typing import Any

from .engine import SamplingParams

FIELDS = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "n", "seed",
          "stop_token_ids", "stop", "images")
MAX_IMAGES = 64
MAX_STOP_STRINGS = 64  # each is searched for after every token of the request: a few are what anyone uses
MAX_STOP_CHARS = 1024
_INT64 = 2**63 - 1  # the sampler turns top_k into an int64 tensor: a larger one fails inside the engine step


class RequestError(ValueError):
    """A request the server refuses with 400; the message names the field and what it must be."""


def parse_completion_request(body: bytes, max_n: int) -> tuple[list[int], SamplingParams, list[str]]:
    """The body of ``POST /v1/completions`` -> (prompt token ids, sampling parameters, image data URLs), or a
    ``RequestError``."""
    req = _json_object(body)
    unknown = sorted(set(req) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown field(s) {', '.join(unknown)}: a request has {', '.join(FIELDS)}")
    if "prompt" not in req:
        raise RequestError("prompt is missing: send the prompt as a list of token ids")
    prompt = req["prompt"]
    if not isinstance(prompt, list) or not prompt or not all(_is_int(t) for t in prompt):
        raise RequestError(f"prompt must be a non-empty list of token ids (ints), got {_show(prompt)}")
    n = _int(req, "n", 1, low=1, high=max_n)
    stop = req.get("stop_token_ids")
    if stop is not None and not (isinstance(stop, list) and all(_is_int(t) for t in stop)):
        raise RequestError(f"stop_token_ids must be null or a list of token ids (ints), got {_show(stop)}")
    seed = req.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"seed must be null or an int, got {_show(seed)}")
    temperature, top_p = _number(req, "temperature", 1.0), _number(req, "top_p", 1.0)
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}")
    min_p, penalty = _number(req, "min_p", 0.0), _number(req, "repetition_penalty", 1.0)
    if not 0 <= min_p <= 1:
        raise RequestError(f"min_p must be in [0, 1] (0 is off), got {min_p}")
    if not penalty > 0:
        raise RequestError(f"repetition_penalty must be > 0 (1 is off), got {penalty}")
    stop_strings = _stop_strings(req.get("stop"))
    params = SamplingParams(max_new_tokens=_int(req, "max_tokens", 64, low=1), temperature=temperature, top_p=top_p,
                            top_k=_int(req, "top_k", 0, low=0), min_p=min_p, repetition_penalty=penalty, n=n,
                            seed=seed, stop_token_ids=tuple(stop) if stop is not None else None, stop=stop_strings)
    images = req.get("images") or []
    if not (isinstance(images, list) and len(images) <= MAX_IMAGES and all(isinstance(i, str) and i for i in images)):
        raise RequestError(f"images must be null or a list of at most {MAX_IMAGES} image data URLs "
                           f"(data:image/png;base64,...), got {_show(images)}")
    return prompt, params, images


def _stop_strings(value: Any) -> tuple[str, ...]:
    """``stop``: null, a string or a list of non-empty strings (OpenAI's API takes either form)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if (not isinstance(items, list) or len(items) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items)):
        raise RequestError(f"stop must be null, a string or a list of at most {MAX_STOP_STRINGS} non-empty strings "
                           f"of at most {MAX_STOP_CHARS} characters, got {_show(value)}")
    return tuple(items)


def to_json(payload: Any) -> bytes:
    """Strict JSON (RFC 8259 has no NaN or Infinity): a non-finite float, such as the logprob of a token sampled
    from NaN logits, is written as null. ``RemoteEngine`` reads a null logprob back as NaN."""
    return json.dumps(_finite(payload), allow_nan=False).encode()


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_object(body: bytes) -> dict:
    try:
        req = json.loads(body, parse_constant=_refuse_constant)
    except RequestError:
        raise
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, a 5000-digit number, nesting too deep
        raise RequestError(f"the body is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(req, dict):
        raise RequestError(f"the body must be a JSON object with a prompt, got {type(req).__name__}")
    return req


def _refuse_constant(name: str):
    raise RequestError(f"the body holds {name}, which is not JSON: every number must be finite")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not token id 1


def _int(req: dict, name: str, default: int, low: int, high: int = _INT64) -> int:
    value = req.get(name, default)
    if _is_int(value) and low <= value <= high:
        return value
    if name == "n":
        raise RequestError(f"n must be an int in [{low}, {high}] (the server's max_n), got {_show(value)}")
    raise RequestError(f"{name} must be an int >= {low}, at most 2**63 - 1, got {_show(value)}")


def _number(req: dict, name: str, default: float) -> float:
    value = req.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {_show(value)}")
    return float(value)


def _show(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
