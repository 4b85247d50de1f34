"""Tool calls parsed out of a model turn's text.

Formats:
- Hermes / Qwen (and SmolLM2, whose function-calling data wraps a JSON list in the same tags): one or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, or ``<tool_call>[{...}, {...}]</tool_call>``;
  ``arguments`` may also be a JSON string of the object (some models emit that).
- transformers' own response parsing where the tokenizer declares a ``response_template``
  (``tokenizer.parse_response``).

A block that is not valid JSON, lacks a name, or is never closed is a *malformed* call: the model is told so in
a tool reply (counted as ``tools/errors/malformed``), like any other failed call.

>>> parse_tool_calls('Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>').calls
[ToolCall(name='add', arguments={'a': 1, 'b': 2})]
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .tools import ToolCall

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN_TAG = "<tool_call>"


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn: its text without the calls (``content``), the well-formed calls in order, and one message per
    malformed call (what the model is told)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)


def parse_tool_calls(text: str, tokenizer=None, tools: list[dict] | None = None) -> ParsedTurn:
    """The calls in ``text``: through ``tokenizer.parse_response`` where the tokenizer declares a response template,
    else the ``<tool_call>`` JSON format."""
    if tokenizer is not None and getattr(tokenizer, "response_template", None):
        return _parse_with_tokenizer(text, tokenizer, tools)
    calls, malformed = [], []
    for body in _BLOCK.findall(text):
        _decode_block(body.strip(), calls, malformed)
    rest = _BLOCK.sub("", text)
    if OPEN_TAG in rest:
        malformed.append("a <tool_call> was opened and never closed with </tool_call>")
        rest = rest[:rest.index(OPEN_TAG)]
    return ParsedTurn(rest.strip(), calls, malformed)


def _decode_block(body: str, calls: list[ToolCall], malformed: list[str]) -> None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        malformed.append(f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {body[:200]}")
        return
    for item in value if isinstance(value, list) else [value]:
        call = _as_call(item)
        (calls if isinstance(call, ToolCall) else malformed).append(call)


def _as_call(item) -> ToolCall | str:
    """A call from ``{"name": ..., "arguments": {...}}`` (arguments possibly a JSON string), or what is wrong."""
    if isinstance(item, dict) and isinstance(item.get("function"), dict):  # OpenAI's {"type": "function", ...}
        item = item["function"]
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return f'a tool call must be a JSON object with a "name" string and "arguments": {json.dumps(item)[:200]}'
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f"the arguments of {item['name']} are a string that is not a JSON object: {arguments[:200]}"
    if arguments is None:
        arguments = {}
    return ToolCall(item["name"], arguments)


def _parse_with_tokenizer(text: str, tokenizer, tools: list[dict] | None) -> ParsedTurn:
    try:
        message = tokenizer.parse_response(text, prefix="", tools=tools)  # text: the model's turn alone
    except Exception as e:  # the model's text did not fit the template's grammar
        return ParsedTurn(text.strip(), [], [f"the response could not be parsed ({type(e).__name__}: {e})"[:300]])
    calls, malformed = [], []
    for item in message.get("tool_calls") or []:
        call = _as_call(item)
        (calls if isinstance(call, ToolCall) else malformed).append(call)
    return ParsedTurn(str(message.get("content") or "").strip(), calls, malformed)
