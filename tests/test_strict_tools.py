"""Calls of ``"strict": true`` tools (CrewAI sends it with every tool): ``server.strict_tools``.

- the constraint itself (:func:`swarmkit.timelines.strict_tools.tool_call_tag`) compiled by xgrammar:
  free text, then a call in the template's wrapping whose arguments match the schema;
- a real server on the hf engine and the tiny random model (``auto``, xgrammar installed: constrained):
  every call of a strict tool matches its schema (an enum and an integer range, which the random model
  breaks unconstrained), streamed or not, for ``tool_choice`` required and named; the timeline is marked
  ``structured``; the same requests with tools sent without ``strict`` are not constrained;
- the mode a server runs with: ``constrain`` on an engine that cannot is refused with what to install,
  ``auto`` falls back to ``check``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from swarmkit.errors import ConfigError
from swarmkit.server.fields import STRICT_HEADER
from swarmkit.timelines.strict_tools import check_mode, tool_call_tag

xgr = pytest.importorskip("xgrammar")  # the grammar extra (in .[dev])

TOKEN = "strict-tools-admin-token-" + "x" * 16
WRAP = ('<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>")
SCHEMA = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
          "required": ["unit", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": SCHEMA, "strict": True}},
         {"type": "function", "function": {"name": "note", "parameters": {"type": "object"}}}]


# --------------------------------------------------------------------------- the constraint
@pytest.fixture(scope="module")
def compiler(tokenizer):
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer), max_threads=1)


def _accepts(compiler, tag: dict[str, Any], text: str) -> bool:
    m = xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)))
    return bool(m.accept_string(text)) and m.is_completed()


def test_the_tag_lets_text_through_and_holds_calls_to_their_schema(compiler):
    tag = tool_call_tag(WRAP, {"forecast": SCHEMA, "note": None})
    good = '<tool_call>\n{"name": "forecast", "arguments": {"unit": "celsius", "days": 3}}\n</tool_call>'
    assert _accepts(compiler, tag, "Let me look. " + good + " Done.")
    assert _accepts(compiler, tag, 'x<tool_call>\n{"name": "note", "arguments": {"any": [1, "thing"]}}\n</tool_call>')
    assert _accepts(compiler, tag, "no call at all")
    assert not _accepts(compiler, tag, good.replace("celsius", "kelvin"))
    assert not _accepts(compiler, tag, good.replace("3", "9"))  # past the maximum
    assert not _accepts(compiler, tag, good.replace("forecast", "weather"))  # not a tool
    assert not _accepts(compiler, tag, good.replace('"days": 3', '"days": 3, "city": "Oslo"'))


def test_an_opened_call_continues_inside_it(compiler):
    named = tool_call_tag(WRAP, {"forecast": SCHEMA, "note": None}, opened="forecast", parallel=False)
    assert _accepts(compiler, named, '{"unit": "fahrenheit", "days": 7}}\n</tool_call>')
    assert not _accepts(compiler, named, '{"unit": "fahrenheit"}}\n</tool_call>')  # a required key is missing
    assert not _accepts(compiler, named, '{"unit": "fahrenheit", "days": 7}}\n</tool_call> more')  # one call only
    required = tool_call_tag(WRAP, {"forecast": SCHEMA, "note": None}, opened="")
    assert _accepts(compiler, required, 'note", "arguments": {}}\n</tool_call> and text')
    assert not _accepts(compiler, required, 'forecast", "arguments": {"days": 1}}\n</tool_call>')
    with pytest.raises(ValueError, match="not among the tools"):
        tool_call_tag(WRAP, {"note": None}, opened="forecast")


def test_the_wrapping_is_the_templates(tokenizer):
    from swarmkit.chat_templates import resolve_chat_template
    from swarmkit.timelines.render import ChatRenderer

    assert ChatRenderer(tokenizer).tool_call_wrapping() == ('<tool_call>{"name": "', '", "arguments": ', "}</tool_call>")
    smol = ChatRenderer(tokenizer, chat_template=resolve_chat_template("builtin:smollm2_tools"))
    assert smol.tool_call_wrapping() == WRAP
    assert smol.tool_call_prefix("f") == '<tool_call>\n{"name": "f", "arguments": '


# --------------------------------------------------------------------------- the mode a server runs with
class _NoGrammar:
    sampling_fields = frozenset({"top_k"})
    structural_tag_hint = "pip install 'swarmkit[grammar]'"


def test_constrain_is_refused_where_the_engine_cannot_and_auto_checks_there():
    assert check_mode("auto", _NoGrammar()) == "check"
    assert check_mode("check", _NoGrammar()) == "check"
    with pytest.raises(ConfigError, match=r"swarmkit\[grammar\]"):
        check_mode("constrain", _NoGrammar())
    with pytest.raises(ConfigError, match="one of auto, constrain, check"):
        check_mode("always", _NoGrammar())


def test_the_hf_engine_constrains_only_with_xgrammar(monkeypatch):
    from swarmkit_plugins.backend_hf import grammar
    from swarmkit_plugins.backend_hf.engine import HFBackend

    assert check_mode("auto", HFBackend(model={"path": "builtin:tiny"})) == "constrain"
    monkeypatch.setattr(grammar, "available", lambda: False)
    without = HFBackend(model={"path": "builtin:tiny"})
    assert check_mode("auto", without) == "check"
    with pytest.raises(ConfigError, match=r"pip install 'swarmkit\[grammar\]'"):
        check_mode("constrain", without)


def test_the_vllm_engine_constrains_only_under_a_grammar_backend_of_structural_tags():
    from swarmkit_plugins.backend_vllm.engine import VLLMBackend  # imports no vllm

    assert check_mode("auto", VLLMBackend(model={"path": "builtin:tiny"})) == "constrain"
    xgr = {"engine_args": {"structured_outputs_config": {"backend": "xgrammar"}}}
    assert check_mode("constrain", VLLMBackend(xgr, model={"path": "builtin:tiny"})) == "constrain"
    guidance = VLLMBackend({"engine_args": {"structured_outputs_config": {"backend": "guidance"}}},
                           model={"path": "builtin:tiny"})
    assert check_mode("auto", guidance) == "check"  # checked and reported, never a 400 per call
    with pytest.raises(ConfigError, match="vLLM's 'guidance' grammar backend .* takes no xgrammar structural tag"):
        check_mode("constrain", guidance)


# --------------------------------------------------------------------------- a real server, the tiny model
def _chat(ep: Any, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(f"{ep.base_url}/chat/completions", timeout=120, headers={"Authorization": f"Bearer {ep.api_key}"},
                   json={"messages": [{"role": "user", "content": "the forecast?"}], "tools": TOOLS,
                         "max_tokens": 96, "temperature": 1.0, "parallel_tool_calls": False, **body})
    assert r.status_code == 200, r.text[:400]
    return r


def _calls(r: httpx.Response, stream: bool) -> list[list[tuple[str, str]]]:
    """Each choice's calls as (name, arguments)."""
    if not stream:
        return [[(c["function"]["name"], c["function"]["arguments"]) for c in ch["message"].get("tool_calls") or []]
                for ch in r.json()["choices"]]
    calls: dict[int, dict[int, list[str]]] = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                for tc in ch["delta"].get("tool_calls") or []:
                    c = calls.setdefault(ch["index"], {}).setdefault(tc["index"], ["", ""])
                    c[0] += tc["function"].get("name") or ""
                    c[1] += tc["function"].get("arguments") or ""
    return [[tuple(c) for _, c in sorted(calls.get(i, {}).items())] for i in range(max(calls, default=-1) + 1)]


def _valid(calls: list[tuple[str, str]]) -> bool:
    try:
        return len(calls) == 1 and calls[0][0] == "forecast" and jsonschema.validate(json.loads(calls[0][1]), SCHEMA) \
            is None
    except (ValueError, jsonschema.ValidationError):
        return False


#: required: the strict tool alone (the random model would fill a free-form object's key until the token limit)
REQUESTS = [({"tool_choice": "required", "n": 4, "seed": 1, "tools": TOOLS[:1]}, False),
            ({"tool_choice": {"type": "function", "function": {"name": "forecast"}}, "n": 4, "seed": 2}, False),
            ({"tool_choice": {"type": "function", "function": {"name": "forecast"}}, "seed": 3}, True)]


@pytest.fixture(scope="module")
def episode(serve_tiny_hf, tmp_path_factory):
    """An episode on a real server: the hf engine, the tiny model, ``server.strict_tools`` left at auto."""
    with serve_tiny_hf(tmp_path_factory.mktemp("strict-tools"), TOKEN) as (_, client), \
            client.episode("strict") as ep:
        yield ep
        ep.report(0.0)


def test_a_strict_tools_call_matches_its_schema_on_the_hf_engine(episode):
    results = []
    for body, stream in REQUESTS:
        r = _chat(episode, {**body, "stream": stream})
        assert STRICT_HEADER not in r.headers
        results += _calls(r, stream)
    tls = episode.timelines()
    assert len(results) == 9 and len(tls) == 9
    assert all(_valid(c) for c in results), results
    assert all(tl["meta"].get("structured") for tl in tls)
    assert not any("strict_violations" in tl["meta"] for tl in tls)


def test_tools_sent_without_strict_are_not_constrained(episode):
    loose = [{"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}}
             for t in TOOLS]
    before = len(episode.timelines())
    results = []
    for body, stream in REQUESTS[:2]:
        results += _calls(_chat(episode, {**body, "stream": stream, "tools": loose[:len(body.get("tools", loose))]}),
                          stream)
    assert not all(_valid(c) for c in results)  # the random model breaks the call unconstrained
    assert not any(tl["meta"].get("structured") for tl in episode.timelines()[before:])


def test_an_answers_response_format_is_checked_like_a_strict_tools_arguments():
    """:func:`format_violations`: nothing asked, nothing to say; not JSON (a raw control character inside a
    string, which a grammar let through on vLLM 0.26: JSON refuses it), not an object, or against the schema."""
    from swarmkit.server.chat_input import format_violations

    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    fmt = {"type": "json_schema", "schema": schema}
    assert format_violations("no json", None) == []
    assert format_violations('{"age": 3}', fmt) == []
    assert format_violations('{"age": 3}', {"type": "json_object"}) == []
    broken = format_violations('{"name": "a\x01b", "age": 3}', fmt)
    assert len(broken) == 1 and broken[0].startswith("response_format: the answer is not JSON (Invalid control")
    assert format_violations("[1, 2]", {"type": "json_object"}) == ["response_format: the answer is not a JSON object"]
    assert format_violations('{"age": "3"}', fmt) == ["response_format: answer['age']: '3' is not of type 'integer'"]
    assert format_violations("{}", fmt) == ["response_format: answer (top level): 'age' is a required property"]
    assert format_violations("", fmt)[0].startswith("response_format: the answer is not JSON")
