"""Tool calls in generated text (Qwen / Hermes ``<tool_call>`` format) → OpenAI tool_calls."""

from __future__ import annotations

import json

import pytest

from swarmkit.timelines.toolcalls import ToolCallStreamParser, parse_tool_calls


def test_text_without_tool_calls_is_left_alone():
    assert parse_tool_calls("Hello <b>world</b>") == ("Hello <b>world</b>", [])


def test_one_call_becomes_openai_tool_call_and_content_is_none():
    content, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert content is None
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "add"
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}


def test_text_around_calls_stays_content_and_several_calls_keep_order():
    text = 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n' \
           '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[1]["function"]["arguments"] == '{"x": 1}'
    assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("bad", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',
    "<tool_call>[1, 2]</tool_call>",
])
def test_malformed_call_is_left_in_the_content(bad):
    assert parse_tool_calls("x " + bad) == ("x " + bad, [])


def test_unterminated_call_at_the_end_is_parsed_when_its_json_is_complete():
    content, calls = parse_tool_calls('ok <tool_call>{"name": "f", "arguments": {"q": "y"}}')
    assert content == "ok" and calls[0]["function"]["name"] == "f"


def stream_parse(text: str, step: int):
    p = ToolCallStreamParser()
    out = [p.feed(text[i : i + step]) for i in range(0, len(text), step)]
    rest, calls = p.finish()
    return "".join(out) + rest, calls


@pytest.mark.parametrize("step", [1, 2, 3, 7, 100])
def test_stream_parser_agrees_with_the_batch_parser(step):
    text = 'Sure <tool_c thing. <tool_call>{"name": "get", "arguments": {"city": "Paris"}}</tool_call> done'
    content, calls = stream_parse(text, step)
    ref_content, ref_calls = parse_tool_calls(text)
    assert content.strip() == ref_content
    assert [c["function"] for c in calls] == [c["function"] for c in ref_calls]


def test_stream_parser_releases_plain_text_at_once():
    p = ToolCallStreamParser()
    assert p.feed("Hello wor") == "Hello wor"
    assert p.feed("ld <tool") == "ld "
    assert p.feed("box>") == "<toolbox>"


def test_stream_parser_keeps_malformed_call_as_content():
    content, calls = stream_parse("a <tool_call>oops</tool_call> b", 4)
    assert calls == [] and content == "a <tool_call>oops</tool_call> b"
