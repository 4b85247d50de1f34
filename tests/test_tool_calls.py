"""Tool calls: parsing every supported format (malformed ones included) and running tools that fail in every way
a user's function can: raising, hanging past the timeout, returning 10 MB, being called wrongly."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from unison.episodes import ToolBox, ToolCall, ToolConfig, parse_tool_calls, tool_schema


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def slow_echo(text: str, delay: float = 0.0) -> str:
    """Echo text after a delay.

    Args:
        text: What to echo.
        delay: Seconds to wait.
    """
    await asyncio.sleep(delay)
    return text


def boom(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"boom {x}")


def hang(x: int) -> int:
    """Never returns in time.

    Args:
        x: Anything.
    """
    time.sleep(30)
    return x


def huge(n: int) -> str:
    """A very long result.

    Args:
        n: Characters.
    """
    return "x" * n


def test_hermes_calls_parse_in_order_with_the_text_around_them():
    text = ('I will add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "slow_echo", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call> done')
    turn = parse_tool_calls(text)
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("slow_echo", {"text": "hi"})]
    assert turn.malformed == [] and turn.content == "I will add. \n done"


def test_smollm2_list_of_calls_in_one_block_parses():
    text = ('<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
            '{"name": "add", "arguments": {"a": 3, "b": 4}}]</tool_call>')
    assert parse_tool_calls(text).calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("add", {"a": 3, "b": 4})]


@pytest.mark.parametrize("text, why", [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "add", "arguments": "a=1"}</tool_call>', "not a JSON object"),
    ('sure <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', "never closed"),
])
def test_malformed_calls_become_messages_not_exceptions(text, why):
    turn = parse_tool_calls(text)
    assert turn.calls == [] and len(turn.malformed) == 1 and why in turn.malformed[0]


def test_plain_text_has_no_calls():
    turn = parse_tool_calls("The answer is 4.")
    assert turn.calls == [] and turn.malformed == [] and turn.content == "The answer is 4."


def test_a_tokenizers_response_template_parses_its_calls():
    from conftest import tiny_tokenizer

    tok = tiny_tokenizer()
    # A format only the tokenizer's declared response template knows (transformers' response parsing)
    tok.response_template = {"start_anchor": "<|im_start|>assistant\n", "fields": {
        "content": {"content": "text"},
        "tool_calls": {"open": "<function>", "close": "</function>", "content": "json", "repeats": True}}}
    turn = parse_tool_calls('ok <function>{"name": "add", "arguments": {"a": 1, "b": 2}}</function>'
                            '<function>{"arguments": {}}</function>', tok, [tool_schema(add)])
    assert turn.content == "ok"
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2})]
    assert len(turn.malformed) == 1 and '"name"' in turn.malformed[0]


def test_schema_comes_from_type_hints_and_docstring_and_a_bad_tool_is_refused():
    schema = tool_schema(add)["function"]
    assert schema["name"] == "add" and schema["parameters"]["properties"]["a"] == {"type": "integer",
                                                                                   "description": "The first."}

    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="undocumented.*type hints"):
        ToolBox([undocumented], ToolConfig())


def test_sync_and_async_tools_run_and_failures_are_reported_by_kind():
    box = ToolBox([add, slow_echo, boom, hang, huge], ToolConfig(timeout_s=0.5, max_result_chars=100))
    t0 = time.perf_counter()
    results = box.call_many([
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("slow_echo", {"text": "hi", "delay": 0.01}),
        ToolCall("boom", {"x": 7}),
        ToolCall("hang", {"x": 1}),
        ToolCall("huge", {"n": 10 * 2**20}),  # 10 MB
        ToolCall("nope", {}),
        ToolCall("add", {"a": 1}),
        ToolCall("add", {"a": "1", "b": 2}),
        ToolCall("add", {"a": 1, "b": 2, "c": 3}),
    ])
    elapsed = time.perf_counter() - t0
    assert elapsed < 3  # the hanging tool is abandoned at its timeout, the others do not wait for it
    assert [r.error for r in results] == [None, None, "exception", "timeout", None, "unknown_tool",
                                          "bad_arguments", "bad_arguments", "bad_arguments"]
    assert results[0].text == "5" and results[1].text == "hi"
    assert "RuntimeError: boom 7" in results[2].text
    assert "timed out after 0.5 s" in results[3].text and results[3].seconds >= 0.5
    assert results[4].truncated and len(results[4].text) == 100 and "10485760 characters" in results[4].text
    assert "tools: add, boom, hang, huge, slow_echo" in results[5].text
    assert "missing a required argument: 'b'" in results[6].text
    assert "a must be integer" in results[7].text
    assert "unexpected keyword argument 'c'" in results[8].text


def test_a_json_result_is_serialised():
    def stats(xs: list[int]) -> dict:
        """Sum and count.

        Args:
            xs: Numbers.
        """
        return {"sum": sum(xs), "n": len(xs)}

    assert json.loads(ToolBox([stats], ToolConfig()).call_many([ToolCall("stats", {"xs": [1, 2]})])[0].text) == {
        "sum": 3, "n": 2}


def test_an_environments_tools_run_one_at_a_time_in_order():
    class Counter:
        def __init__(self):
            self.log = []

        def step(self, n: int) -> int:
            """Record n.

            Args:
                n: A number.
            """
            time.sleep(0.05 if n == 0 else 0.0)  # the first call is the slow one
            self.log.append(n)
            return len(self.log)

    env = Counter()
    box = ToolBox([env.step], ToolConfig(), sequential=True)
    results = box.call_many([ToolCall("step", {"n": i}) for i in range(3)])
    assert env.log == [0, 1, 2] and [r.text for r in results] == ["1", "2", "3"]


def test_the_calls_of_every_episode_in_a_step_run_at_once():
    from unison.episodes.loop import _run_all

    def nap(s: float) -> str:
        """Sleep.

        Args:
            s: Seconds.
        """
        time.sleep(s)
        return "up"

    boxes = [ToolBox([nap], ToolConfig(), sequential=True) for _ in range(4)]
    t0 = time.perf_counter()
    results = _run_all([(box, [ToolCall("nap", {"s": 0.3})]) for box in boxes] + [(boxes[0], [])])
    assert time.perf_counter() - t0 < 1.0  # four episodes' 0.3 s calls together, not 1.2 s one after another
    assert [[r.text for r in rs] for rs in results] == [["up"]] * 4 + [[]]
