"""One request model per endpoint: its validation, the field table and the OpenAPI body come from it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from swarmkit.errors import ApiError
from swarmkit.server import fields
from swarmkit.server.openapi import openapi_document
from swarmkit.server.schema.anthropic import CountTokensRequest, MessagesRequest
from swarmkit.server.schema.control import (
    AbortRequest,
    ConfigureRequest,
    DemonstrationRequest,
    HeartbeatRequest,
    PrepareRequest,
    ReadyRequest,
    RegisterRequest,
    ReportRequest,
)
from swarmkit.server.schema.openai import ChatRequest, CompletionsRequest
from swarmkit.server.schema.responses import ResponsesRequest
from swarmkit.server.schema.spec import Number, Refused, spec

MODELS = {"/v1/chat/completions": (ChatRequest, fields.CHAT), "/v1/completions": (CompletionsRequest, fields.COMPLETIONS),
          "/v1/messages": (MessagesRequest, fields.MESSAGES),
          "/v1/messages/count_tokens": (CountTokensRequest, fields.COUNT_TOKENS),
          "/v1/responses": (ResponsesRequest, fields.RESPONSES)}


def _body(path: str) -> dict:
    return openapi_document()["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]


@pytest.mark.parametrize("path", list(MODELS))
def test_the_field_table_and_the_document_come_from_the_model(path):
    model, table = MODELS[path]
    assert table == model.table() and table.endpoint == path
    body = _body(path)
    assert body == model.openapi_body()
    assert set(body["properties"]) == table.known | table.ignored  # the document lists every field of the table


def test_a_field_added_to_the_model_shows_up_in_the_table_the_document_and_the_checks():
    @dataclass
    class Wider(ChatRequest):
        knob: float = spec(Number(0, 1, 0.5, "a new knob"))
        gadget: None = spec(Refused((), "gadgets are not supported"))

    table = Wider.table()
    assert {"knob", "gadget"} <= table.known and not {"knob", "gadget"} & table.ignored
    props = Wider.openapi_body()["properties"]
    assert props["knob"] == {"type": "number", "minimum": 0, "maximum": 1, "description": "a new knob"}
    assert "gadgets are not supported" in props["gadget"]["description"]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert Wider.parse(chat).knob == 0.5 and Wider.parse({**chat, "knob": 0.25}).knob == 0.25
    with pytest.raises(ApiError) as e:
        Wider.parse({**chat, "knob": 2})
    assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_value", "knob")
    with pytest.raises(ApiError) as e:
        Wider.parse({**chat, "gadget": 1})
    assert (e.value.code, e.value.param) == ("unsupported_field", "gadget")


def test_chat_request_to_sampling_params():
    req = ChatRequest.parse({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 50,
                             "max_tokens": 9, "temperature": 0.5, "top_p": 0, "stop": ["", "x"], "n": 2, "seed": 7,
                             "logprobs": True, "top_logprobs": 3})
    params = req.to_sampling_params(40, None)
    assert (params.max_tokens, params.temperature, params.top_p, params.n, params.stop, params.seed,
            params.top_logprobs) == (40, 0.5, 1e-9, 2, ["x"], 7, 3)
    assert ChatRequest.parse({"messages": [{"role": "user", "content": "hi"}]}).to_sampling_params(30, None
                                                                                                  ).max_tokens == 30
    with pytest.raises(ApiError) as e:
        ChatRequest.parse({})
    assert (e.value.code, e.value.param) == ("missing_field", "messages")
    with pytest.raises(ApiError) as e:
        ChatRequest.parse({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert e.value.param == "top_logprobs"


def test_completions_request_to_sampling_params():
    req = CompletionsRequest.parse({"prompt": "hi", "logprobs": 2, "stop": "x"})
    assert req.prompt == ["hi"]
    params = req.to_sampling_params(100, None)
    assert (params.max_tokens, params.top_logprobs, params.stop) == (16, 2, ["x"])
    assert CompletionsRequest.parse({"prompt": "hi", "echo": True, "max_tokens": 0, "logprobs": 1}).scores_only
    assert not CompletionsRequest.parse({"prompt": "hi", "echo": True, "max_tokens": 3}).scores_only
    for body, code, param in [({}, "missing_field", "prompt"),
                              ({"prompt": "hi", "echo": 0}, "invalid_value", "echo"),
                              ({"prompt": "hi", "max_tokens": 0}, "invalid_value", "max_tokens"),
                              ({"prompt": "hi", "echo": True, "stream": True}, "unsupported_value", "echo"),
                              ({"prompt": "hi", "n": 2, "best_of": 2}, "unsupported_field", "best_of"),
                              ({"prompt": "hi", "functions": [{}]}, "unsupported_field", "functions")]:
        with pytest.raises(ApiError) as e:
            CompletionsRequest.parse(body)
        assert (e.value.code, e.value.param) == (code, param), body


def test_responses_request_to_sampling_params():
    req = ResponsesRequest.parse({"input": "hi", "max_output_tokens": 50, "temperature": 0.5, "top_logprobs": 3,
                                  "instructions": "be brief", "text": {"format": {"type": "text"}}})
    params = req.to_sampling_params(40, None)
    assert (params.max_tokens, params.temperature, params.top_logprobs, params.response_format) == (40, 0.5, 3, None)
    assert req.logprobs and req.instructions == "be brief" and req.tool_choice.mode == "none"
    plain = ResponsesRequest.parse({"input": "hi", "include": ["message.output_text.logprobs"]})
    assert plain.logprobs and plain.to_sampling_params(30, None).top_logprobs == 0
    # Codex's include (reasoning items already carry their text in content): accepted, no logprobs
    codex = ResponsesRequest.parse({"input": "hi", "reasoning": {}, "include": ["reasoning.encrypted_content"]})
    assert not codex.logprobs
    for body, code, param in [({}, "missing_field", "input"), ({"input": "hi", "truncation": "auto"},
                                                                "unsupported_field", "truncation"),
                              ({"input": "hi", "reasoning": {"effort": "high"}}, "unsupported_field", "reasoning"),
                              ({"input": "hi", "include": ["x"]}, "unsupported_field", "include"),
                              ({"input": "hi", "instructions": 3}, "invalid_value", "instructions"),
                              ({"input": "hi", "stream": "yes"}, "invalid_value", "stream"),
                              ({"input": "hi", "tools": [{"type": "web_search"}]}, "unsupported_field", "tools[0]"),
                              ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "invalid_value",
                               "text.format")]:
        with pytest.raises(ApiError) as e:
            ResponsesRequest.parse(body)
        assert (e.value.code, e.value.param) == (code, param), body


#: the control API's bodies: their OpenAPI body is the model's, and their field errors are 422
CONTROL = {"/api/v1/episodes": RegisterRequest, "/api/v1/episodes/{episode_id}/report": ReportRequest,
           "/api/v1/episodes/{episode_id}/prepare": PrepareRequest,
           "/api/v1/episodes/{episode_id}/abort": AbortRequest,
           "/api/v1/episodes/{episode_id}/demonstration": DemonstrationRequest,
           "/api/v1/clients/ready": ReadyRequest, "/api/v1/clients/heartbeat": HeartbeatRequest,
           "/api/v1/admin/configure": ConfigureRequest}


@pytest.mark.parametrize("path", list(CONTROL))
def test_the_control_bodies_come_from_their_models(path):
    model = CONTROL[path]
    assert model.endpoint == path and _body(path) == model.openapi_body()
    assert set(_body(path)["properties"]) == model.table().known


@pytest.mark.parametrize("model, body, status, code, param", [
    (RegisterRequest, {}, 422, "missing_field", "task_id"),
    (RegisterRequest, {"task_id": ""}, 422, "invalid_field", "task_id"),
    (RegisterRequest, {"task_id": "t", "eval": None}, 422, "invalid_field", "eval"),
    (RegisterRequest, {"task_id": "t", "roles": ["a", "a"]}, 422, "invalid_field", "roles"),
    (RegisterRequest, {"task_id": "t", "meta": []}, 422, "invalid_field", "meta"),
    (RegisterRequest, {"task_id": "t", "client_id": "x" * 129}, 422, "invalid_field", "client_id"),
    (ReportRequest, {"meta": {}}, 422, "missing_field", "reward"),
    (PrepareRequest, {"reward": 1, "primary": {"url": "ftp://x", "episode_id": "e", "api_key": "k"}}, 422,
     "invalid_field", "primary.url"),
    (AbortRequest, {"reason": None}, 422, "invalid_field", "reason"),
    (DemonstrationRequest, {}, 400, "missing_field", "messages"),
    (ReadyRequest, {}, 422, "invalid_field", "ready"),
    (HeartbeatRequest, {"interval_s": 600}, 422, "invalid_field", "interval_s"),
    (ConfigureRequest, {"config": {}, "yaml": "a: 1"}, 422, "missing_field", "config"),
    (ConfigureRequest, {"overrides": "backend=hf"}, 422, "invalid_field", "overrides"),
])
def test_the_control_bodies_answer_422_naming_the_field(model, body, status, code, param):
    with pytest.raises(ApiError) as e:
        model.parse(body)
    assert (e.value.status, e.value.code, e.value.param) == (status, code, param)


def test_the_control_bodies_read_their_defaults():
    reg = RegisterRequest.parse({"task_id": 7})
    assert (reg.task_id, reg.eval, reg.meta, reg.roles, reg.client_id) == ("7", False, {}, None, None)
    assert AbortRequest.parse({}).reason == "aborted by the client"
    assert HeartbeatRequest.parse({}).interval_s is None and ReadyRequest.parse({"ready": True}).ready
