"""Tool calls in generated text (Qwen / Hermes ``<tool_call>`` format) → OpenAI tool_calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
    assert content == ref_content == "Sure <tool_c thing. done"
    assert [c["function"] for c in calls] == [c["function"] for c in ref_calls]


# --------------------------------------------------------------------------- issue 37: streamed == non-streamed
TWO_CALLS = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "b", "arguments": {"y": 2}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_the_newline_between_two_calls_is_not_content_streamed_or_not(step):
    content, calls = stream_parse(TWO_CALLS, step)
    assert content == ""  # nothing was streamed as content
    assert parse_tool_calls(TWO_CALLS)[0] is None
    assert [c["function"]["name"] for c in calls] == ["a", "b"]


@pytest.mark.parametrize("text, content", [
    ("Let me see.\n<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n", "Let me see."),
    ("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n\nDone.\n", "Done."),
    ("A.\n<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call> and B.", "A. and B."),
    ("  \n <tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>  ", None),
    ("  x  \n", "  x  \n"),  # no call: the text as generated
])
def test_whitespace_next_to_calls_is_dropped_alike(text, content):
    assert parse_tool_calls(text)[0] == content
    for step in (1, 3):
        assert stream_parse(text, step)[0] == (content or "")


def test_arguments_are_the_models_text_verbatim():
    """Not re-serialised: a streamed call is sent as generated, so the non-streamed one is the same text."""
    for text in ('<tool_call>{"name": "f", "arguments": {"b":2,  "a": [1,2]}}</tool_call>',
                 '<tool_call>{"arguments": {"b":2,  "a": [1,2]}, "name": "f"}</tool_call>',
                 '<tool_call>{"name": "f", "parameters": {"b":2,  "a": [1,2]}}</tool_call>'):
        (call,) = parse_tool_calls(text)[1]
        assert call["function"]["arguments"] == '{"b":2,  "a": [1,2]}', text
        (streamed,) = stream_parse(text, 2)[1]
        assert streamed["function"] == call["function"]
    # a nested key of the same name is not taken for the call's
    (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"arguments": {}}}</tool_call>')[1]
    assert call["function"]["arguments"] == '{"arguments": {}}'


_PIECES = ["Hi", " ", "\n", "ok.", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {"q":1}}',
           '{"name": "g", "arguments": "{}"}', "{oops}", "<tool", "}", '{"name": "h", "arguments": {']


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=12), st.integers(1, 9))
def test_streamed_and_whole_parses_are_equal_for_any_text(pieces, step):
    text = "".join(pieces)
    content, calls = stream_parse(text, step)
    ref_content, ref_calls = parse_tool_calls(text)
    assert content == (ref_content or "")
    if not ref_calls:
        assert content == text
    assert [c["function"] for c in calls] == [c["function"] for c in ref_calls]


def test_stream_parser_releases_plain_text_at_once():
    """Only what could begin a call is held: a ``<tool`` prefix, and whitespace (it may sit right before a call)."""
    p = ToolCallStreamParser()
    assert p.feed("Hello wor") == "Hello wor"
    assert p.feed("ld <tool") == "ld"
    assert p.feed("box>") == " <toolbox>"
    assert p.feed("\n") == ""
    assert p.finish() == ("\n", [])


def test_stream_parser_keeps_malformed_call_as_content():
    content, calls = stream_parse("a <tool_call>oops</tool_call> b", 4)
    assert calls == [] and content == "a <tool_call>oops</tool_call> b"
