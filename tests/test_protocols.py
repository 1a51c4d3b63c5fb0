"""Anthropic Messages and OpenAI Responses through their official SDKs, against a real server
(uvicorn on 127.0.0.1, scripted backend): streaming event sequences, multi-turn tool use,
errors in each protocol's own shape, stored responses kept within their episode, the field
table (unknown fields answered in a header, or refused in strict mode; fields the server
cannot honour refused), count_tokens, /v1/models/{id}, /tokenize and /detokenize.

The calc agent in each protocol, token-identical to Chat Completions, is in test_frameworks.py;
the real tiny model's tokens and logprobs through both endpoints, in test_server_e2e.py.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from swarmkit.client import SwarmClient  # noqa: E402
from swarmkit.timelines.merging import merge_timelines  # noqa: E402

TOKEN = "protocols-admin-token-" + "x" * 16
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
TOOL_A = {"name": "calculator", "description": "Evaluate arithmetic.",
          "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}
TOOL_R = {"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": TOOL_A["input_schema"]}


def script(prompt: str) -> str:
    """Call the calculator once; after a tool result, answer; 'STOPWORD' shows a stop sequence."""
    if prompt.rstrip().endswith('"arguments":'):  # a forced call: the server prefilled its opening
        return '{"expression": "2 + 3"}}\n</tool_call>'
    if "STOPWORD" in prompt:
        return "one two STOP three"
    if "5" in prompt.split("calculator")[-1] and ("tool_response" in prompt or "<|im_start|>tool" in prompt):
        return "The answer is 5."
    if "add" in prompt:
        return CALL
    return "Hello there."


def _start(tmp_path_factory, *overrides):
    from swarmkit.apps.serve import start_server_thread
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.plugins import get_registry
    from swarmkit.testing.scripted import ScriptedBackend

    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, replies=lambda ids: script(tok.decode(ids)))
    config = validate_config(compose(["model=tiny", "model.chat_template=builtin:smollm2_tools", *overrides]), get_registry())
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("protocols"))}},
                            config=config, backend_factory=lambda cfg: backend, train=False)
    client = SwarmClient(h.url, token=TOKEN, retry_for=10)
    client.start()
    client.wait_for_state("ROLLING", timeout=30)
    return h, client


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    h, client = _start(tmp_path_factory)
    yield client
    client.close()
    h.stop()


@pytest.fixture(scope="module")
def strict_swarm(tmp_path_factory):
    h, client = _start(tmp_path_factory, "server.strict_fields=true")
    yield client
    client.close()
    h.stop()


def _anthropic(ep):
    return anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)


def _openai(ep):
    return openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)


# --------------------------------------------------------------------------- Anthropic Messages
def test_anthropic_streamed_tool_use_then_text(swarm):
    with swarm.episode("a-stream") as ep:
        llm = _anthropic(ep)
        messages = [{"role": "user", "content": "add 2 and 3"}]
        with llm.messages.stream(model="swarm", max_tokens=64, system="Use the tool.", messages=messages,
                                 tools=[TOOL_A]) as stream:
            kinds = [e.type for e in stream]
            first = stream.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert kinds.index("content_block_start") < kinds.index("content_block_stop") < kinds.index("message_delta")
        (use,) = first.content
        assert (use.type, use.name, use.input) == ("tool_use", "calculator", {"expression": "2 + 3"})
        assert first.stop_reason == "tool_use" and first.usage.output_tokens > 0
        messages += [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
        with llm.messages.stream(model="swarm", max_tokens=64, system="Use the tool.", messages=messages,
                                 tools=[TOOL_A]) as stream:
            text = "".join(stream.text_stream)
            second = stream.get_final_message()
        assert text == "The answer is 5." == second.content[0].text and second.stop_reason == "end_turn"
        ep.report(1.0)
        tls = ep.timelines(as_objects=True)
    assert [(tl.meta["endpoint"], tl.meta["stream"], tl.meta["complete"]) for tl in tls] == [("messages", True, True)] * 2
    (sample,) = merge_timelines(tls, "token")  # the tool_use turn was replayed with its own tokens
    assert sample.token_ids() == tls[-1].token_ids()


def test_anthropic_non_streamed_answer_and_stop_sequence(swarm):
    with swarm.episode("a-plain") as ep:
        llm = _anthropic(ep)
        r = llm.messages.create(model="swarm", max_tokens=32, messages=[{"role": "user", "content": "hi"}])
        assert r.content[0].text == "Hello there." and r.stop_reason == "end_turn" and r.role == "assistant"
        r = llm.messages.create(model="swarm", max_tokens=32, stop_sequences=["STOP"],
                                messages=[{"role": "user", "content": "STOPWORD"}])
        assert (r.content[0].text, r.stop_reason, r.stop_sequence) == ("one two ", "stop_sequence", "STOP")
        r = llm.messages.create(model="swarm", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2
        ep.report(0.0)


def test_anthropic_tool_choice_any_forces_a_call(swarm):
    with swarm.episode("a-any") as ep:
        r = _anthropic(ep).messages.create(model="swarm", max_tokens=64, tools=[TOOL_A],
                                           tool_choice={"type": "tool", "name": "calculator"},
                                           messages=[{"role": "user", "content": "add"}])
        assert r.content[-1].type == "tool_use" and r.stop_reason == "tool_use"
        ep.report(0.0)


def test_count_tokens_is_the_prompt_the_call_uses(swarm):
    with swarm.episode("a-count") as ep:
        llm = _anthropic(ep)
        kwargs = {"model": "swarm", "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}],
                  "tools": [TOOL_A]}
        counted = llm.messages.count_tokens(**kwargs).input_tokens
        assert counted == llm.messages.create(max_tokens=8, **kwargs).usage.input_tokens > 0
        ep.report(0.0)


def test_anthropic_errors_have_anthropics_shape(swarm):
    with swarm.episode("a-errors") as ep:
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key="wrong", max_retries=0).messages.create(
                model="swarm", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
        with pytest.raises(anthropic.BadRequestError, match=r"messages\[0\]\.content\[0\] is a 'image' block"):
            _anthropic(ep).messages.create(model="swarm", max_tokens=8, messages=[{"role": "user", "content": [image]}])
        for bad, match in [({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
                           ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config"),
                           ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool")]:
            with pytest.raises(anthropic.BadRequestError, match=match):
                _anthropic(ep).messages.create(model="swarm", max_tokens=8,
                                               messages=[{"role": "user", "content": "hi"}], **bad)
        r = httpx.post(f"{ep.anthropic_base_url}/v1/messages", headers={"x-api-key": ep.api_key},
                       json={"model": "swarm", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"] == {"type": "invalid_request_error",
                                                              "message": "missing required field 'max_tokens'"}
        ep.report(0.0)


def test_a_base_url_with_v1_gets_a_hint(swarm):
    with swarm.episode("a-v1") as ep:
        with pytest.raises(anthropic.NotFoundError, match="anthropic_base_url"):
            anthropic.Anthropic(base_url=ep.base_url, api_key=ep.api_key, max_retries=0).messages.create(
                model="swarm", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        ep.report(0.0)


# --------------------------------------------------------------------------- OpenAI Responses
def test_responses_streamed_function_call_then_text(swarm):
    with swarm.episode("r-stream") as ep:
        llm = _openai(ep)
        events = list(llm.responses.create(model="swarm", input="add 2 and 3", tools=[TOOL_R], stream=True))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert "response.function_call_arguments.done" in kinds
        first = events[-1].response
        (call,) = first.output
        assert call.type == "function_call" and json.loads(call.arguments) == {"expression": "2 + 3"}
        events = list(llm.responses.create(model="swarm", previous_response_id=first.id, tools=[TOOL_R], stream=True,
                                           input=[{"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "5"}]))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        final = events[-1].response
        assert deltas == "The answer is 5." == final.output_text and final.status == "completed"
        assert final.usage.output_tokens > 0
        assert llm.responses.retrieve(final.id).output_text == "The answer is 5."
        ep.report(1.0)
        tls = ep.timelines(as_objects=True)
    assert [tl.meta["endpoint"] for tl in tls] == ["responses"] * 2
    (sample,) = merge_timelines(tls, "token")
    assert sample.token_ids() == tls[-1].token_ids()


def test_responses_non_streamed_and_incomplete(swarm):
    with swarm.episode("r-plain") as ep:
        llm = _openai(ep)
        r = llm.responses.create(model="swarm", input=[{"role": "user", "content": [{"type": "input_text",
                                                                                      "text": "hi"}]}])
        assert r.output_text == "Hello there." and r.status == "completed" and r.output[0].role == "assistant"
        r = llm.responses.create(model="swarm", input="hi", max_output_tokens=2)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        ep.report(0.0)


def test_stored_responses_stay_in_their_episode(swarm):
    with swarm.episode("r-one") as one, swarm.episode("r-two") as two:
        r = _openai(one).responses.create(model="swarm", input="hi")
        unstored = _openai(one).responses.create(model="swarm", input="hi", store=False)
        with pytest.raises(openai.BadRequestError, match="previous response"):
            _openai(two).responses.create(model="swarm", input="again", previous_response_id=r.id)
        with pytest.raises(openai.BadRequestError, match="previous response"):
            _openai(one).responses.create(model="swarm", input="again", previous_response_id=unstored.id)
        with pytest.raises(openai.NotFoundError):
            _openai(two).responses.retrieve(r.id)
        assert _openai(one).responses.create(model="swarm", input="again", previous_response_id=r.id).output_text
        one.report(0.0)
        two.report(0.0)


def test_responses_refuse_what_they_cannot_honour(swarm):
    with swarm.episode("r-errors") as ep:
        llm = _openai(ep)
        for bad, param in [({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
                           ({"reasoning": {"effort": "high"}}, "reasoning"),
                           ({"tools": [{"type": "web_search"}]}, "tools[0]"),
                           ({"input": [{"role": "user", "content": [{"type": "input_image",
                                                                     "image_url": "data:,"}]}]},
                            "input[0].content[0]")]:
            with pytest.raises(openai.BadRequestError) as e:
                llm.responses.create(model="swarm", **{"input": "hi", **bad})
            assert e.value.body["param"] == param, e.value.body
        ep.report(0.0)


def test_the_agents_sdk_streams_a_run_on_responses(swarm):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    async def calculator(ctx, arguments: str) -> str:
        return "5"

    tool = agents.FunctionTool(name="calculator", description="Evaluate arithmetic.",
                               params_json_schema=TOOL_A["input_schema"], on_invoke_tool=calculator,
                               strict_json_schema=False)
    with swarm.episode("r-agents") as ep:
        model = agents.OpenAIResponsesModel(model="swarm", openai_client=openai.AsyncOpenAI(
            base_url=ep.base_url, api_key=ep.api_key, max_retries=0))
        agent = agents.Agent(name="calc", instructions="Use the tool.", model=model, tools=[tool])

        async def run():
            result = agents.Runner.run_streamed(agent, "add 2 and 3")
            kinds = [e.type async for e in result.stream_events()]
            return result.final_output, kinds

        final, kinds = asyncio.run(run())
        assert final == "The answer is 5." and "raw_response_event" in kinds
        ep.report(1.0)
        assert len(merge_timelines(ep.timelines(as_objects=True), "token")) == 1


# --------------------------------------------------------------------------- the field table
def test_unknown_fields_are_named_in_a_header(swarm):
    with swarm.episode("f-unknown") as ep:
        auth = {"Authorization": f"Bearer {ep.api_key}"}
        r = httpx.post(f"{ep.base_url}/chat/completions", headers=auth,
                       json={"messages": [{"role": "user", "content": "hi"}], "bogus_field": 1, "user": "u1",
                             "x_trace": "ok"})
        assert r.status_code == 200 and r.headers["x-swarm-ignored-fields"] == "bogus_field"
        r = httpx.post(f"{ep.base_url}/responses", headers=auth, json={"input": "hi", "metadata": {"a": "b"}})
        assert r.status_code == 200 and "x-swarm-ignored-fields" not in r.headers
        ep.report(0.0)


def test_strict_mode_refuses_unknown_fields(strict_swarm):
    with strict_swarm.episode("f-strict") as ep:
        with pytest.raises(openai.BadRequestError, match="unknown field 'bogus_field'"):
            _openai(ep).chat.completions.create(model="swarm", messages=[{"role": "user", "content": "hi"}],
                                                extra_body={"bogus_field": 1})
        with pytest.raises(anthropic.BadRequestError, match="unknown field 'bogus_field'"):
            _anthropic(ep).messages.create(model="swarm", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"bogus_field": 1})
        assert _openai(ep).chat.completions.create(model="swarm", messages=[{"role": "user", "content": "hi"}],
                                                   user="u1").choices[0].message.content == "Hello there."
        ep.report(0.0)


@pytest.mark.parametrize("field,value", [("response_format", {"type": "json_object"}), ("logit_bias", {"5": 10}),
                                         ("frequency_penalty", 0.5), ("reasoning_effort", "high")])
def test_chat_fields_that_change_the_answer_are_refused(swarm, field, value):
    with swarm.episode("f-refused") as ep:
        with pytest.raises(openai.BadRequestError) as e:
            _openai(ep).chat.completions.create(model="swarm", messages=[{"role": "user", "content": "hi"}],
                                                extra_body={field: value})
        assert e.value.body["param"] == field and e.value.body["code"] == "unsupported_field"
        ep.report(0.0)


# --------------------------------------------------------------------------- models, tokenize
def test_models_tokenize_and_detokenize(swarm):
    with swarm.episode("m") as ep:
        llm = _openai(ep)
        name = llm.models.list().data[0].id
        assert llm.models.retrieve(name).id == name
        with pytest.raises(openai.NotFoundError):
            llm.models.retrieve("gpt-nope")
        auth = {"Authorization": f"Bearer {ep.api_key}"}
        root = ep.server_url
        toks = httpx.post(f"{root}/tokenize", headers=auth, json={"prompt": "hello world"}).json()
        assert toks["count"] == len(toks["tokens"]) > 0
        assert httpx.post(f"{root}/detokenize", headers=auth, json={"tokens": toks["tokens"]}).json() == \
            {"prompt": "hello world"}
        chat = httpx.post(f"{root}/tokenize", headers=auth, json={"messages": [{"role": "user", "content": "hi"}]})
        used = llm.chat.completions.create(model="swarm", messages=[{"role": "user", "content": "hi"}])
        assert chat.json()["count"] == used.usage.prompt_tokens
        assert httpx.post(f"{root}/detokenize", headers=auth, json={"tokens": [-1]}).status_code == 400
        assert httpx.post(f"{root}/tokenize", json={"prompt": "x"}).status_code == 401
        ep.report(0.0)


# --------------------------------------------------------------------------- tool calls streamed as generated
def test_tool_call_arguments_stream_as_they_are_generated(swarm):
    """A call written {"name", "arguments": {...}} is announced once its name is known and its
    arguments follow in pieces, in each protocol; the pieces join into the call's arguments."""
    with swarm.episode("incremental") as ep:
        auth = {"Authorization": f"Bearer {ep.api_key}"}
        chat = httpx.post(f"{ep.base_url}/chat/completions", headers=auth, json={
            "messages": [{"role": "user", "content": "add"}], "tools": [{"type": "function", "function": {
                "name": "calculator", "parameters": TOOL_A["input_schema"]}}], "stream": True})
        pieces = [c for line in chat.text.splitlines() if line.startswith("data: {")
                  for ch in json.loads(line[6:])["choices"] for c in ch["delta"].get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "calculator" and pieces[0]["id"].startswith("call_")
        args = "".join(p["function"].get("arguments", "") for p in pieces)
        assert len(pieces) > 3 and json.loads(args) == {"expression": "2 + 3"}

        with _anthropic(ep).messages.stream(model="swarm", max_tokens=64, messages=[
                {"role": "user", "content": "add"}], tools=[TOOL_A]) as stream:
            deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"
                      and e.delta.type == "input_json_delta"]
            final = stream.get_final_message()
        assert len(deltas) > 3 and final.content[-1].input == {"expression": "2 + 3"}

        events = list(_openai(ep).responses.create(model="swarm", input="add", tools=[TOOL_R], stream=True))
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        (call,) = events[-1].response.output
        assert len(deltas) > 3 and "".join(deltas) == call.arguments
        assert json.loads(call.arguments) == {"expression": "2 + 3"}
        ep.report(0.0)
