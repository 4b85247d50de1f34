"""Tools: plain Python functions (sync or async) the model calls during an episode.

A tool's JSON schema comes from its type hints and docstring, as transformers' ``get_json_schema`` reads them
(the schema is what the chat template shows the model). Every call runs in its own daemon thread with a wall-time
limit; whatever goes wrong (an unknown tool, arguments that do not fit the signature, an exception, a call past its
timeout) becomes an error message the model reads in the tool's reply, counted by kind, never an exception out of
the rollout. A result longer than ``max_result_chars`` is cut, with a note saying so.

>>> def add(a: int, b: int) -> int:
...     '''Add two integers.
...
...     Args:
...         a: The first.
...         b: The second.
...     '''
...     return a + b
>>> box = ToolBox([add], ToolConfig())
>>> box.call_many([ToolCall("add", {"a": 2, "b": 3})])[0].text
'5'
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from transformers.utils import get_json_schema

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "exception", "timeout")
"""What a failed tool call is counted as (``tools/errors/<kind>``)."""


@dataclass
class ToolConfig:
    timeout_s: float = 10.0
    """Wall time one tool call may take; past it the model is told the call timed out (the thread is abandoned)."""
    max_result_chars: int = 2000
    """A tool's result (or error) is cut to this many characters before it goes back to the model."""

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"ToolConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_result_chars < 1:
            raise ValueError(f"ToolConfig.max_result_chars must be >= 1, got {self.max_result_chars}")


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: a tool name and its (JSON-decoded) arguments."""

    name: str
    arguments: dict


@dataclass(frozen=True)
class ToolResult:
    """What goes back to the model: ``text`` (the result, or the error message), the error's kind (None for a
    success), the call's wall time, and whether the text was cut to ``max_result_chars``."""

    name: str
    text: str
    error: str | None = None
    seconds: float = 0.0
    truncated: bool = False


def tool_schema(fn: Callable) -> dict:
    """The function's JSON schema (``{"type": "function", "function": {...}}``); a clear error when its docstring or
    type hints do not say enough."""
    try:
        return get_json_schema(fn)
    except Exception as e:
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r}: no JSON schema can be read from its signature and "
                         f"docstring ({e}). A tool needs type hints on every argument and a Google-style docstring "
                         "with an 'Args:' section describing each one") from e


class ToolBox:
    """The tools of one episode (or of a whole run: plain functions hold no episode state), by name.
    ``sequential``: one call at a time, in order (an environment's methods share its state); else all at once."""

    def __init__(self, tools: list[Callable], cfg: ToolConfig, sequential: bool = False):
        self.cfg = cfg
        self.sequential = sequential
        self.tools: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        for fn in tools:
            schema = tool_schema(fn)
            name = schema["function"]["name"]
            if name in self.tools:
                raise ValueError(f"two tools are named {name!r}")
            self.tools[name] = fn
            self.schemas.append(schema)

    def call_many(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Run the calls, each in its own thread under its own timeout (at once unless ``sequential``); results in
        call order."""
        slots: list[ToolResult | None] = [None] * len(calls)
        threads: list[tuple[int, threading.Thread, float]] = []
        for i, call in enumerate(calls):
            fn = self.tools.get(call.name)
            if fn is None:
                known = ", ".join(sorted(self.tools)) or "none"
                slots[i] = self._result(call.name, f"unknown tool {call.name!r} (tools: {known})", "unknown_tool")
                continue
            problem = _argument_problem(fn, self.schemas[list(self.tools).index(call.name)], call.arguments)
            if problem is not None:
                slots[i] = self._result(call.name, f"bad arguments for {call.name}: {problem}", "bad_arguments")
                continue
            thread = threading.Thread(target=self._run, args=(fn, call, slots, i), daemon=True)
            threads.append((i, thread, time.perf_counter()))
            thread.start()
            if self.sequential:
                self._wait(threads[-1:], calls, slots)
        self._wait(threads, calls, slots)
        return slots  # type: ignore[return-value]

    def _wait(self, threads: list[tuple[int, threading.Thread, float]], calls: list[ToolCall], slots: list) -> None:
        for i, thread, started in threads:
            thread.join(max(started + self.cfg.timeout_s - time.perf_counter(), 0.0))
            if slots[i] is None:  # still running (or it died without a result)
                slots[i] = self._result(calls[i].name, f"{calls[i].name} timed out after {self.cfg.timeout_s:g} s",
                                        "timeout", time.perf_counter() - started)

    def _run(self, fn: Callable, call: ToolCall, slots: list, i: int) -> None:
        t0 = time.perf_counter()
        try:
            value = fn(**call.arguments)
            if inspect.isawaitable(value):
                value = asyncio.run(_awaited(value))
            text, error = _as_text(value), None
        except Exception as e:  # a user's tool must not end the run: the model reads what went wrong
            text, error = f"{call.name} raised {type(e).__name__}: {e}", "exception"
        if slots[i] is None:  # not already reported as timed out
            slots[i] = self._result(call.name, text, error, time.perf_counter() - t0)

    def _result(self, name: str, text: str, error: str | None, seconds: float = 0.0) -> ToolResult:
        shown = cut(text, self.cfg.max_result_chars)
        return ToolResult(name, shown, error, seconds, truncated=shown != text)


def in_background(fn: Callable, *args) -> Future:
    """``fn(*args)`` in a daemon thread of its own (a hung call never holds the process at exit, as an executor's
    worker would); its result or exception in the returned future."""
    future: Future = Future()
    future.set_running_or_notify_cancel()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # handed to whoever reads the future
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


def cut(text: str, limit: int) -> str:
    """``text``, or where it is longer than ``limit`` characters its start with a note saying so (``limit`` long)."""
    if len(text) <= limit:
        return text
    note = f"... [cut: {len(text)} characters, the first {limit} shown]"
    return text[:max(limit - len(note), 0)] + note


async def _awaited(awaitable):
    return await awaitable


def _as_text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


_JSON_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool, "array": list,
               "object": dict}


def _argument_problem(fn: Callable, schema: dict, arguments) -> str | None:
    """Why ``arguments`` do not fit the tool (its signature, the JSON types of its schema), or None."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as e:
        return str(e)
    properties = schema["function"].get("parameters", {}).get("properties", {})
    for name, value in arguments.items():
        wanted = _JSON_TYPES.get(properties.get(name, {}).get("type"))
        is_bool = isinstance(value, bool)
        if wanted is not None and (not isinstance(value, wanted) or (is_bool and wanted is not bool)):
            return f"{name} must be {properties[name]['type']}, got {json.dumps(value)[:80]}"
    return None
