"""Issue 37: a streamed answer equals the non-streamed one, and the recorded timeline says what the answer said.

A real server on 127.0.0.1 (uvicorn in a thread) answers from a script (:class:`ScriptedBackend`, the
built-in tiny tokenizer). For each protocol (Chat Completions, Anthropic Messages, OpenAI Responses) the
same generated text is asked for streamed and not: the content, the tool calls (their arguments the
model's text verbatim, never re-serialised) and the finish reason must be equal, whitespace between
two calls is not content, and every recorded timeline's ``meta.finish_reason`` is the answer's.
Tools sent with ``strict: true`` (CrewAI sends it on every tool) are accepted; a call that breaks its
schema is answered as generated and reported (``X-Swarm-Strict-Violations``, ``meta.strict_violations``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from swarmkit.client import SwarmClient
from swarmkit.server.fields import STRICT_HEADER

TOKEN = "consistency-admin-token-" + "x" * 16
#: two calls with a newline between them; the arguments are written compactly and oddly spaced
TWO = ('<tool_call>\n{"name": "weather", "arguments": {"city":"Paris"}}\n</tool_call>\n'
       '<tool_call>\n{"name": "weather", "arguments": {"city":  "Rome" }}\n</tool_call>')
#: text, a call, more text, a call
MIXED = ('Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city":"Oslo"}}\n</tool_call>\n'
         'And then:\n<tool_call>\n{"name": "weather", "arguments": {"city":"Bern"}}\n</tool_call>')
#: a call whose arguments break the tool's schema
BAD = '<tool_call>\n{"name": "weather", "arguments": {"town": "Paris"}}\n</tool_call>'
SCRIPT = {"TWO": TWO, "MIXED": MIXED, "BAD": BAD}

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
CHAT_TOOL = {"type": "function", "function": {"name": "weather", "description": "the weather of a city",
                                              "parameters": SCHEMA}}
STRICT_CHAT_TOOL = {"type": "function", "function": {**CHAT_TOOL["function"], "strict": True}}
FLAT_TOOL = {"type": "function", "name": "weather", "description": "the weather of a city", "parameters": SCHEMA}
ANTHROPIC_TOOL = {"name": "weather", "description": "the weather of a city", "input_schema": SCHEMA}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from swarmkit.apps.wiring import build_server
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.plugins import get_registry
    from swarmkit.server.run import run_in_thread
    from swarmkit.testing.scripted import ScriptedBackend

    tok = build_tiny_tokenizer()

    def reply(ids: list[int]) -> str:
        prompt = tok.decode(ids)
        return next((text for key, text in SCRIPT.items() if key in prompt), "Hello.")

    config = validate_config(compose(["model=tiny"]), get_registry())
    srv, app = build_server({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("consistency"))}},
                            train=False, config=config, backend_factory=lambda cfg: ScriptedBackend(tok, replies=reply))
    handle = run_in_thread(srv, app)
    client = SwarmClient(handle.url, token=TOKEN, retry_for=10)
    try:
        client.start()
        client.wait_for_state("ROLLING", timeout=30)
        yield client
    finally:
        client.close()
        handle.stop()


def _post(ep: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(f"{ep.base_url}{path}", json=body, timeout=60, headers={"Authorization": f"Bearer {ep.api_key}"})
    assert r.status_code == 200, r.text[:400]
    return r


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


# --------------------------------------------------------------------------- each protocol's answer, as one dict
def _chat_answer(ep: Any, key: str, stream: bool, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": key}], "tools": tools or [CHAT_TOOL], "stream": stream}
    r = _post(ep, "/chat/completions", body)
    if not stream:
        (choice,) = r.json()["choices"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls", [])]
        return {"content": choice["message"]["content"], "calls": calls, "finish_reason": choice["finish_reason"],
                "headers": r.headers}
    content, calls, finish = "", {}, None
    for chunk in _events(r):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                name, args = calls.get(tc["index"], ("", ""))
                calls[tc["index"]] = (name + (tc["function"].get("name") or ""), args + tc["function"]["arguments"])
            finish = choice["finish_reason"] or finish
    return {"content": content or None, "calls": [calls[k] for k in sorted(calls)], "finish_reason": finish,
            "headers": r.headers}


def _messages_answer(ep: Any, key: str, stream: bool) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": key}], "tools": [ANTHROPIC_TOOL], "max_tokens": 128,
            "stream": stream}
    r = _post(ep, "/messages", body)
    if not stream:
        msg = r.json()
        return {"blocks": [(b["type"], b.get("text", b.get("input"))) for b in msg["content"]],
                "stop_reason": msg["stop_reason"]}
    blocks: list[list[Any]] = []
    stop = None
    for e in _events(r):
        if e["type"] == "content_block_start":
            blocks.append([e["content_block"]["type"], ""])
        elif e["type"] == "content_block_delta":
            d = e["delta"]
            blocks[-1][1] += d.get("text", d.get("partial_json", ""))
        elif e["type"] == "message_delta":
            stop = e["delta"]["stop_reason"]
    return {"blocks": [(kind, json.loads(text) if kind == "tool_use" else text) for kind, text in blocks],
            "stop_reason": stop}


def _responses_answer(ep: Any, key: str, stream: bool) -> dict[str, Any]:
    r = _post(ep, "/responses", {"input": key, "tools": [FLAT_TOOL], "stream": stream})
    response = r.json() if not stream else next(e["response"] for e in _events(r) if e["type"] == "response.completed")
    items = [(it["type"], it["content"][0]["text"] if it["type"] == "message" else (it["name"], it["arguments"]))
             for it in response["output"]]
    return {"items": items, "status": response["status"]}


def _recorded_finish_reasons(ep: Any) -> list[str]:
    return [tl["meta"]["finish_reason"] for tl in ep.timelines()]


# --------------------------------------------------------------------------- (a) + (b): streamed == non-streamed
def test_chat_two_calls_streamed_and_not_are_equal(server):
    with server.episode("chat-two") as ep:
        whole, streamed = _chat_answer(ep, "TWO", False), _chat_answer(ep, "TWO", True)
        ep.report(0.0)
    expected = [("weather", '{"city":"Paris"}'), ("weather", '{"city":  "Rome" }')]  # verbatim
    assert whole["calls"] == streamed["calls"] == expected
    assert whole["content"] is None and streamed["content"] is None  # the "\n" between the calls is not content
    assert whole["finish_reason"] == streamed["finish_reason"] == "tool_calls"


def test_chat_text_between_calls_streamed_and_not_are_equal(server):
    with server.episode("chat-mixed") as ep:
        whole, streamed = _chat_answer(ep, "MIXED", False), _chat_answer(ep, "MIXED", True)
        ep.report(0.0)
    assert whole["content"] == streamed["content"] == "Let me look.\nAnd then:"  # no gluing
    assert whole["calls"] == streamed["calls"] == [("weather", '{"city":"Oslo"}'), ("weather", '{"city":"Bern"}')]


@pytest.mark.parametrize("key", ["TWO", "MIXED"])
def test_messages_streamed_and_not_are_equal_blocks_in_order(server, key):
    with server.episode(f"messages-{key}") as ep:
        whole, streamed = _messages_answer(ep, key, False), _messages_answer(ep, key, True)
        ep.report(0.0)
    assert whole == streamed
    assert whole["stop_reason"] == "tool_use"
    if key == "MIXED":
        assert [kind for kind, _ in whole["blocks"]] == ["text", "tool_use", "text", "tool_use"]
    else:
        assert whole["blocks"] == [("tool_use", {"city": "Paris"}), ("tool_use", {"city": "Rome"})]


@pytest.mark.parametrize("key", ["TWO", "MIXED"])
def test_responses_streamed_and_not_are_equal_items_in_order(server, key):
    with server.episode(f"responses-{key}") as ep:
        whole, streamed = _responses_answer(ep, key, False), _responses_answer(ep, key, True)
        ep.report(0.0)
    assert whole == streamed
    if key == "TWO":
        assert whole["items"] == [("function_call", ("weather", '{"city":"Paris"}')),
                                  ("function_call", ("weather", '{"city":  "Rome" }'))]
    else:
        assert [kind for kind, _ in whole["items"]] == ["message", "function_call", "message", "function_call"]
        assert whole["items"][2] == ("message", "\nAnd then:")


# --------------------------------------------------------------------------- (c): the recorded finish reason
def test_the_recorded_finish_reason_is_the_answers(server):
    with server.episode("finish-reasons") as ep:
        answers = [_chat_answer(ep, "TWO", False)["finish_reason"], _chat_answer(ep, "TWO", True)["finish_reason"],
                   _chat_answer(ep, "plain", False)["finish_reason"]]
        _messages_answer(ep, "TWO", False)
        _messages_answer(ep, "TWO", True)
        _responses_answer(ep, "TWO", False)
        _responses_answer(ep, "TWO", True)
        recorded = _recorded_finish_reasons(ep)
        ep.report(0.0)
    assert answers == ["tool_calls", "tool_calls", "stop"]
    assert recorded == [*answers, *["tool_calls"] * 4]


def test_a_call_cut_by_the_token_limit_says_length_in_answer_and_record(server):
    with server.episode("cut") as ep:
        body = {"messages": [{"role": "user", "content": "TWO"}], "tools": [CHAT_TOOL], "max_tokens": 30}
        whole = _post(ep, "/chat/completions", body).json()["choices"][0]
        streamed = _events(_post(ep, "/chat/completions", {**body, "stream": True}))[-1]["choices"][0]
        recorded = _recorded_finish_reasons(ep)
        ep.report(0.0)
    assert whole["finish_reason"] == streamed["finish_reason"] == "length"
    assert recorded == ["length", "length"]


# --------------------------------------------------------------------------- strict tools (CrewAI)
def test_strict_tools_are_accepted_and_a_conforming_call_is_not_flagged(server):
    with server.episode("strict-ok") as ep:
        for stream in (False, True):
            answer = _chat_answer(ep, "TWO", stream, tools=[STRICT_CHAT_TOOL])
            assert answer["calls"] == [("weather", '{"city":"Paris"}'), ("weather", '{"city":  "Rome" }')]
            assert STRICT_HEADER not in answer["headers"]
        tls = ep.timelines()
        ep.report(0.0)
    assert all("strict_violations" not in tl["meta"] for tl in tls)


def test_a_call_breaking_a_strict_schema_is_answered_and_reported(server):
    with server.episode("strict-bad") as ep:
        whole = _chat_answer(ep, "BAD", False, tools=[STRICT_CHAT_TOOL])
        streamed = _chat_answer(ep, "BAD", True, tools=[STRICT_CHAT_TOOL])
        not_strict = _chat_answer(ep, "BAD", False)
        messages = _post(ep, "/messages", {"messages": [{"role": "user", "content": "BAD"}], "max_tokens": 64,
                                           "tools": [{**ANTHROPIC_TOOL, "strict": True}]})
        responses = _post(ep, "/responses", {"input": "BAD", "tools": [{**FLAT_TOOL, "strict": True}]})
        tls = ep.timelines()
        ep.report(0.0)
    assert whole["calls"] == streamed["calls"] == [("weather", '{"town": "Paris"}')]  # as generated
    report = httpx.QueryParams(f"v={whole['headers'][STRICT_HEADER]}")["v"]  # percent-encoded
    assert report.startswith("tool_calls[0] (weather): arguments")
    assert "'city' is a required property" in report and "'town' was unexpected" in report
    assert STRICT_HEADER not in streamed["headers"] and STRICT_HEADER not in not_strict["headers"]
    assert STRICT_HEADER in messages.headers and STRICT_HEADER in responses.headers
    flagged = ["strict_violations" in tl["meta"] for tl in tls]
    assert flagged == [True, True, False, True, True]
    assert "'city' is a required property" in " ".join(tls[1]["meta"]["strict_violations"])


def test_strict_must_be_a_boolean(server):
    with server.episode("strict-type") as ep:
        bad = {"type": "function", "function": {**CHAT_TOOL["function"], "strict": "yes"}}
        r = httpx.post(f"{ep.base_url}/chat/completions", timeout=60, headers={"Authorization": f"Bearer {ep.api_key}"},
                       json={"messages": [{"role": "user", "content": "TWO"}], "tools": [bad]})
        ep.report(0.0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.strict"
