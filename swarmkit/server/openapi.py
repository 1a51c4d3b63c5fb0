"""The OpenAPI 3.1 description of a swarm server's HTTP API, served at ``GET /openapi.json``.

The request bodies of the inference endpoints and of the episode and client routes are derived
from their request models (:mod:`swarmkit.server.schema`), the same declarations the handlers
validate with; the rest is written by hand from the routes (``swarmkit/server/routes/``).
Unknown request fields are allowed (the server names them in ``X-Swarm-Ignored-Fields``
unless ``server.strict_fields`` refuses them), so request objects stay open.
``tests/test_openapi.py`` fails when a route of ``app.py`` is not described here, and
fuzzes every operation with schemathesis. The prose reference is docs/server_api.md.
"""

from __future__ import annotations

import copy

from swarmkit import __version__
from swarmkit.server.schema.anthropic import CountTokensRequest, MessagesRequest
from swarmkit.server.schema.control import (
    AbortRequest,
    AddAdapterRequest,
    ConfigureRequest,
    DemonstrationRequest,
    HeartbeatRequest,
    PrepareRequest,
    ReadyRequest,
    RegisterRequest,
    ReportRequest,
)
from swarmkit.server.schema.jsonschema import (
    ANY_OBJECT,
    BOOL,
    STRICT_TOOL,
    Schema,
    array,
    enum,
    integer,
    nullable,
    number,
    obj,
    ref,
    string,
)
from swarmkit.server.schema.openai import ChatRequest, CompletionsRequest
from swarmkit.server.schema.responses import ResponsesRequest

Security = list[dict[str, list[str]]]

#: security requirements, by who may call
ADMIN: Security = [{"adminToken": []}]
DASHBOARD: Security = [{"adminToken": []}, {"dashboardSession": []}]
EPISODE: Security = [{"episodeKey": []}]
EPISODE_OR_ADMIN: Security = [{"episodeKey": []}, {"adminToken": []}]
ANTHROPIC: Security = [{"episodeKey": []}, {"anthropicApiKey": []}]
CLIENT: Security = [{}, {"clientToken": []}]  # open unless the server has a client token
PUBLIC: Security = []


def json_body(schema: Schema, *, required: bool = True) -> Schema:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


#: one server-sent event of a streamed answer (the schema applies per event); the stream ends as the
#: protocol ends it (``data: [DONE]`` for OpenAI's, ``message_stop`` / ``response.completed`` events)
SSE_EVENT: Schema = {"type": "object", "properties": {
    "event": {"type": "string"}, "data": {"type": "string", "description": "a JSON object, or [DONE]"},
    "id": {"type": "string"}, "retry": {"type": "integer"}}}


def answer(description: str, schema: Schema | None = None, *, stream: bool = False,
           headers: dict[str, Schema] | None = None) -> Schema:
    """A success response: JSON (and ``text/event-stream`` when the request may ask for a stream)."""
    content: Schema = {"application/json": {"schema": schema or ANY_OBJECT}}
    if stream:
        content["text/event-stream"] = {"schema": SSE_EVENT}
    out: Schema = {"description": description, "content": content}
    if headers:
        out["headers"] = headers
    return out


#: what each error status means, for the response descriptions
_ERRORS = {
    400: "invalid request: malformed JSON, an invalid or unsupported field (the protocol's own 400)",
    401: "no token, or a key that names no episode",
    403: "a token of the wrong kind, or another episode's key",
    404: "unknown episode, response, model or route",
    409: "conflict: the episode ended or is prepared, the server is already started, ...",
    410: "the episode passed its deadline",
    413: "body over server.max_body_bytes",
    422: "a field of the swarm API is missing or invalid (every problem named)",
    429: "a quota: running episodes, calls per episode",
    503: "busy (a training step, booting, offline): retry after Retry-After seconds",
}

_RETRY_HEADERS = {
    "Retry-After": {"description": "whole seconds to wait (at least 1)", "schema": {"type": "integer"}},
    "X-Swarm-Retry-After-Ms": {"description": "the expected wait itself, in milliseconds",
                               "schema": {"type": "integer"}},
}

#: the error statuses every operation may answer (the body-size limit is checked before any route)
_ALWAYS = (413,)


def errors(*codes: int, anthropic: bool = False) -> dict[str, Schema]:
    """Error responses with the protocol's error shape (Anthropic's under ``/v1/messages``)."""
    schema = ref("AnthropicError" if anthropic else "Error")
    out: dict[str, Schema] = {}
    for code in sorted(set(codes) | set(_ALWAYS)):
        resp: Schema = {"description": _ERRORS[code], "content": {"application/json": {"schema": schema}}}
        if code in (429, 503):
            resp["headers"] = _RETRY_HEADERS
        out[str(code)] = resp
    return out


def op(summary: str, tag: str, security: Security, responses: dict[str, Schema], *,
       body: Schema | None = None, parameters: list[Schema] | None = None, description: str | None = None,
       operation_id: str) -> Schema:
    """One operation object."""
    out: Schema = {"operationId": operation_id, "summary": summary, "tags": [tag], "security": security,
                   "responses": responses}
    if description:
        out["description"] = description
    if body is not None:
        out["requestBody"] = body
    if parameters:
        out["parameters"] = parameters
    return out


def param(name: str, where: str, schema: Schema, *, required: bool = False, description: str | None = None) -> Schema:
    out: Schema = {"name": name, "in": where, "required": required or where == "path", "schema": schema}
    if description:
        out["description"] = description
    return out


EPISODE_ID = param("episode_id", "path", string(min_length=1),
                   description="the episode's id (``ep-...``), as registration answered it")
CLIENT_HEADER = param("X-Swarm-Client", "header", {"type": "string"},
                      description="the client id of the caller (the SDK sends a stable one per client); at most 128 "
                                  "characters where it names the client (register, votes; a body's client_id "
                                  "replaces it), its first 128 elsewhere")
CLIENT_KEY_HEADER = param("X-Swarm-Client-Key", "header", {"type": "string"},
                          description="the key that holds the client id (issued by its first vote or heartbeat)")
IGNORED_HEADERS = {"X-Swarm-Ignored-Fields": {
    "description": "the request's unknown fields, percent-encoded and comma-separated; past 1024 characters "
                   "the rest are counted as '+N more' (absent when there are none)",
    "schema": {"type": "string"}}}


# --------------------------------------------------------------------------- shared schemas
def _components() -> Schema:
    text_part = obj({"type": enum("text", "input_text", "output_text", "refusal"), "text": string(),
                     "refusal": string()}, ("type",),
                    description="a text content part (image, audio and file parts are refused with 400)")
    tool_call = obj({"id": string(), "type": enum("function"),
                     "function": obj({"name": string(), "arguments": {"anyOf": [string(), ANY_OBJECT]}},
                                     ("name",))}, ("function",))
    chat_message = obj({
        "role": enum("system", "developer", "user", "assistant", "tool"),
        "content": {"anyOf": [string(), array(text_part), {"type": "null"}],
                    "description": "null only for an assistant message with tool_calls"},
        "name": string(),
        "tool_calls": nullable(array(tool_call)),
        "tool_call_id": string(),
        "reasoning_content": string("an assistant turn's reasoning (thinking models)"),
    }, ("role",))
    function = obj({"name": string(), "description": string(), "parameters": ANY_OBJECT,
                    "strict": nullable({"type": "boolean", "description": STRICT_TOOL})}, ("name",))
    chat_tool = obj({"type": enum("function"), "function": function}, ("function",))
    chat_tool_choice = {"anyOf": [enum("none", "auto", "required"),
                                  obj({"type": enum("function"), "function": obj({"name": string()}, ("name",))},
                                      ("function",))]}
    response_format = obj({"type": enum("text", "json_object", "json_schema"),
                           "json_schema": obj({"name": string(), "schema": ANY_OBJECT, "strict": BOOL}),
                           "schema": ANY_OBJECT}, ("type",),
                          description="structured output: honoured on engines with guided decoding (vllm), "
                                      "else 400; json_schema needs a schema object (in json_schema, or beside type)")
    stop = {"anyOf": [string(), array(string(), max_items=16)]}
    error = obj({"error": obj({"message": string(), "type": string(), "code": nullable(string()),
                               "param": nullable(string())}, ("message", "type"))}, ("error",),
                description="every error outside /v1/messages (OpenAI's shape)")
    anthropic_error = obj({"type": enum("error"), "error": obj({"type": string(), "message": string()},
                                                               ("type", "message"))}, ("type", "error"),
                          description="every error under /v1/messages (Anthropic's shape)")
    episode = obj({
        "episode_id": string(), "task_id": string(), "eval": BOOL, "client_id": nullable(string()),
        "status": enum("running", "prepared", "committing", "finished", "aborted"),
        "roles": nullable(array(string())), "created": number(), "deadline": number(), "ended": nullable(number()),
        "reward": nullable(number()), "rewards": nullable({"type": "object"}), "abort_reason": nullable(string()),
        "n_calls": integer(), "n_timelines": integer(), "policy_version": integer(), "accepted": nullable(BOOL),
        "meta": ANY_OBJECT}, ("episode_id", "status"))
    reward = {"anyOf": [number(-1e6, 1e6), {"type": "object", "additionalProperties": number(-1e6, 1e6)}],
              "description": "a finite number, or one per role (every role); at most server.max_abs_reward "
                             "(1e6) in size"}
    result = obj({"episode_id": string(), "status": string(), "reward": nullable(number()),
                  "rewards": nullable(ANY_OBJECT), "accepted": nullable(BOOL), "n_timelines": integer(),
                  "not_accepted": string("why a training episode was not accepted")},
                 ("episode_id", "status"))
    return {
        "securitySchemes": {
            "adminToken": {"type": "http", "scheme": "bearer",
                           "description": "the admin token (server.admin_token, $SWARMKIT_ADMIN_TOKEN, or the file "
                                          "<run_dir>/admin_token): 401 without it, 403 with a wrong one"},
            "episodeKey": {"type": "http", "scheme": "bearer",
                           "description": "an episode key (api_key or a role's key from registration); every route "
                                          "also reads it from x-api-key or api-key when there is no Authorization"},
            "anthropicApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                                "description": "an episode key as the Anthropic SDK sends it"},
            "dashboardSession": {"type": "apiKey", "in": "cookie", "name": "swarmkit_session",
                                 "description": "the session a dashboard login sets (HttpOnly, SameSite=Strict)"},
            "clientToken": {"type": "http", "scheme": "bearer",
                            "description": "the client token (server.client_token or $SWARMKIT_CLIENT_TOKEN), or "
                                           "the admin token; needed only when the server has one"},
        },
        "schemas": {
            "Error": error, "AnthropicError": anthropic_error,
            "TextPart": text_part, "ToolCall": tool_call, "ChatMessage": chat_message, "ChatTool": chat_tool,
            "ChatToolChoice": chat_tool_choice, "ResponseFormat": response_format, "Stop": stop,
            "Episode": episode, "Reward": reward, "EpisodeResult": result,
            "LogitBias": {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                          "additionalProperties": number(-100, 100),
                          "description": "token id -> bias (where the engine honours it)"},
        },
    }


# --------------------------------------------------------------------------- the paths
def _inference_paths() -> dict[str, Schema]:
    call_errors = (400, 401, 403, 409, 410, 429, 503)
    chat_answer = obj({"id": string(), "object": enum("chat.completion"), "model": string(),
                       "choices": array(ANY_OBJECT), "usage": ANY_OBJECT}, ("id", "choices"))
    completion_answer = obj({"id": string(), "object": enum("text_completion"), "model": string(),
                             "choices": array(ANY_OBJECT), "usage": ANY_OBJECT}, ("id", "choices"))
    model = obj({"id": string(), "object": enum("model"), "created": integer(), "owned_by": string(),
                 "policy_version": integer()}, ("id", "object"))
    message = obj({"id": string(), "type": enum("message"), "role": enum("assistant"), "content": array(ANY_OBJECT),
                   "stop_reason": string(), "usage": ANY_OBJECT}, ("id", "type", "content"))
    response = obj({"id": string(), "object": enum("response"), "status": string(), "output": array(ANY_OBJECT),
                    "usage": nullable(ANY_OBJECT)}, ("id", "object", "status"))
    tag = "inference"
    return {
        "/v1/chat/completions": {"post": op(
            "OpenAI Chat Completions", tag, EPISODE, operation_id="chatCompletions", body=json_body(ChatRequest.openapi_body()),
            responses={"200": answer("a chat completion (SSE chunks with stream: true)", chat_answer, stream=True,
                                     headers=IGNORED_HEADERS), **errors(*call_errors)})},
        "/v1/completions": {"post": op(
            "OpenAI Completions (raw prompts, no chat template)", tag, EPISODE, operation_id="completions",
            body=json_body(CompletionsRequest.openapi_body()),
            responses={"200": answer("a text completion", completion_answer, stream=True, headers=IGNORED_HEADERS),
                       **errors(*call_errors)})},
        "/v1/messages": {"post": op(
            "Anthropic Messages", tag, ANTHROPIC, operation_id="messages", body=json_body(MessagesRequest.openapi_body()),
            responses={"200": answer("a message (Anthropic's events with stream: true)", message, stream=True,
                                     headers=IGNORED_HEADERS), **errors(*call_errors, anthropic=True)})},
        "/v1/messages/count_tokens": {"post": op(
            "Anthropic token count: the length of the prompt the same request would generate from", tag, ANTHROPIC,
            operation_id="countTokens", body=json_body(CountTokensRequest.openapi_body()),
            responses={"200": answer("the prompt length", obj({"input_tokens": integer(0)}, ("input_tokens",)),
                                     headers=IGNORED_HEADERS), **errors(*call_errors, anthropic=True)})},
        "/v1/responses": {"post": op(
            "OpenAI Responses", tag, EPISODE, operation_id="createResponse", body=json_body(ResponsesRequest.openapi_body()),
            responses={"200": answer("a response (its events with stream: true)", response, stream=True,
                                     headers=IGNORED_HEADERS), **errors(*call_errors)})},
        "/v1/responses/{response_id}": {"get": op(
            "A response this episode stored", tag, EPISODE, operation_id="getResponse",
            parameters=[param("response_id", "path", {"type": "string", "minLength": 1})],
            responses={"200": answer("the stored response", response), **errors(401, 403, 404, 409, 410, 429, 503)})},
        "/v1/models": {"get": op(
            "The served model", tag, EPISODE_OR_ADMIN, operation_id="listModels",
            responses={"200": answer("a list of one model", obj({"object": enum("list"), "data": array(model)},
                                                                ("object", "data"))), **errors(401, 403)})},
        "/v1/models/{model_id}": {"get": op(
            "The served model under its name (any other name: 404)", tag, EPISODE_OR_ADMIN,
            operation_id="getModel", parameters=[param("model_id", "path", {"type": "string", "minLength": 1},
                                                       description="the model's name (it may hold slashes)")],
            responses={"200": answer("the model", model), **errors(401, 403, 404)})},
        "/tokenize": {"post": op(
            "Tokenize a prompt, or a chat rendered with the template (vLLM's shape)", tag, EPISODE_OR_ADMIN,
            operation_id="tokenize",
            body=json_body({**obj({"prompt": string(), "messages": array(ref("ChatMessage"), min_items=1),
                                   "tools": nullable(array(ref("ChatTool")))}),
                            "anyOf": [{"required": ["prompt"]}, {"required": ["messages"]}]}),
            responses={"200": answer("the token ids", obj({"count": integer(0), "tokens": array(integer(0)),
                                                           "max_model_len": nullable(integer())},
                                                          ("count", "tokens"))), **errors(400, 401, 403, 503)})},
        "/detokenize": {"post": op(
            "Token ids back to text", tag, EPISODE_OR_ADMIN, operation_id="detokenize",
            body=json_body(obj({"tokens": array(integer(0))}, ("tokens",))),
            responses={"200": answer("the text", obj({"prompt": string()}, ("prompt",))),
                       **errors(400, 401, 403, 503)})},
    }


def _controller_paths() -> dict[str, Schema]:
    tag = "controller"
    state = obj({"state": enum("OFFLINE", "BOOTING", "ROLLING", "ROLLING_POST", "WEIGHT_SYNCING")}, ("state",))
    status = obj({"state": string(), "since": number(), "last_error": nullable(string()), "global_step": integer(),
                  "policy_version": integer(), "configured": BOOL, "model": nullable(string()),
                  "training_finished": nullable(string()), "episodes": ANY_OBJECT, "pool": ANY_OBJECT,
                  "clients": ANY_OBJECT, "engine": ANY_OBJECT,
                  "replicas": nullable(array(ANY_OBJECT, description="per inference replica (backend.replicas > 1): "
                                                                    "index, device, alive, error, in_flight, "
                                                                    "episodes, policy_version")),
                  "calls": integer(), "tokens_generated": integer(), "uptime_s": number()},
                 ("state",))
    return {
        "/api/v1/health": {"get": op(
            "State and step; no token (load balancers, waiting clients)", tag, PUBLIC, operation_id="health",
            responses={"200": answer("the state", obj({"state": string(), "global_step": integer(),
                                                       "error": nullable(string())},
                                                      ("state", "global_step", "error")))})},
        "/api/v1/status": {"get": op(
            "The whole status", tag, ADMIN, operation_id="status",
            responses={"200": answer("the status", status), **errors(401, 403)})},
        "/api/v1/admin/configure": {"post": op(
            "Set the training config (applies at the next start/restart while running)", tag, ADMIN,
            operation_id="configure", body=json_body(ConfigureRequest.openapi_body()),
            responses={"200": answer("the config as validated (tokens redacted)",
                                     obj({"state": string(), "config": ANY_OBJECT, "note": nullable(string())},
                                         ("state", "config"))), **errors(400, 401, 403, 422)})},
        "/api/v1/admin/start": {"post": op(
            "Load the model and start serving (poll the status for ROLLING)", tag, ADMIN, operation_id="start",
            responses={"202": answer("booting", state), **errors(401, 403, 409)})},
        "/api/v1/admin/stop": {"post": op(
            "Stop serving: running episodes are aborted", tag, ADMIN, operation_id="stop",
            responses={"200": answer("stopped", state), **errors(401, 403)})},
        "/api/v1/admin/restart": {"post": op(
            "Stop, then start with the latest config", tag, ADMIN, operation_id="restart",
            responses={"202": answer("booting", state), **errors(401, 403, 409)})},
        "/api/v1/admin/checkpoint": {"post": op(
            "Save config, status (and trainer state) under <run_dir>/checkpoints/step_<n>", tag, ADMIN,
            operation_id="checkpoint",
            responses={"200": answer("where it was saved", obj({"path": string(), "global_step": integer(),
                                                                "weights": BOOL}, ("path", "global_step"))),
                       **errors(401, 403, 409)})},
        "/api/v1/admin/resume_training": {"post": op(
            "Resume training paused by the collapse alarm (trainer.collapse.action=pause)", tag, ADMIN,
            operation_id="resumeTraining",
            responses={"200": answer("whether it was paused", obj({"resumed": BOOL, "global_step": integer()},
                                                                  ("resumed", "global_step"))),
                       **errors(401, 403)})},
        "/api/v1/admin/adapters": {"post": op(
            "Add a LoRA adapter to a server started with model.adapters: trained and served from now on", tag,
            ADMIN, operation_id="addAdapter", body=json_body(AddAdapterRequest.openapi_body()),
            responses={"200": answer("the adapter added", obj({"adapter": string(), "adapters": array(string()),
                                                               "global_step": integer(), "note": nullable(string())},
                                                              ("adapter", "adapters"))),
                       **errors(400, 401, 403, 409, 422)})},
        "/api/v1/episodes": {
            "get": op("Summaries of running episodes (and the last N ended ones)", tag, ADMIN,
                      operation_id="listEpisodes",
                      parameters=[param("ended", "query", integer(), description="how many ended episodes to add")],
                      responses={"200": answer("the summaries", obj({"running": array(ref("Episode")),
                                                                     "ended": array(ref("Episode"))},
                                                                    ("running", "ended"))),
                                 **errors(401, 403, 422)}),
            "post": _register(),
        },
    }


def _register() -> Schema:
    registered = obj({"episode_id": string(), "base_url": string(), "anthropic_base_url": string(),
                      "api_key": string(), "keys": nullable({"type": "object", "additionalProperties": string()}),
                      "roles": nullable(array(string())), "task_id": string(), "eval": BOOL, "deadline": number(),
                      "timeout_s": number(), "policy_version": integer(), "model": nullable(string())},
                     ("episode_id", "base_url", "api_key"))
    return op("Register an episode: its id, base URLs and keys", "episodes", CLIENT, operation_id="registerEpisode",
              body=json_body(RegisterRequest.openapi_body()), parameters=[CLIENT_HEADER],
              responses={"201": answer("registered", registered), **errors(400, 401, 403, 409, 422, 429, 503)})


def _episode_paths() -> dict[str, Schema]:
    tag = "episodes"
    params = [EPISODE_ID, CLIENT_HEADER]
    end_errors = (400, 401, 403, 404, 409, 410, 422, 503)
    prepared = obj({"episode_id": string(), "status": enum("prepared"), "reward": number(),
                    "rewards": nullable(ANY_OBJECT), "deadline": number()}, ("episode_id", "status"))
    timelines = obj({"episode_id": string(), "status": string(), "task_id": string(),
                     "timelines": array(ANY_OBJECT, description="Timeline.to_dict(): blocks, role, meta")},
                    ("episode_id", "timelines"))
    e = "/api/v1/episodes/{episode_id}"
    return {
        e: {"get": op("An episode's summary", tag, EPISODE_OR_ADMIN, operation_id="getEpisode", parameters=params,
                      responses={"200": answer("the summary", ref("Episode")), **errors(401, 403, 404)})},
        f"{e}/report": {"post": op(
            "End the episode with its reward (a training episode goes to the pool first)", tag, EPISODE,
            operation_id="reportEpisode", parameters=params,
            body=json_body(ReportRequest.openapi_body()),
            responses={"200": answer("finished", ref("EpisodeResult")), **errors(*end_errors)})},
        f"{e}/abort": {"post": op(
            "End the episode without a sample", tag, EPISODE, operation_id="abortEpisode", parameters=params,
            body=json_body(AbortRequest.openapi_body(), required=False),
            responses={"200": answer("aborted", obj({"episode_id": string(), "status": string(),
                                                     "reason": nullable(string())}, ("episode_id", "status"))),
                       **errors(400, 401, 403, 404, 409, 410, 422)})},
        f"{e}/prepare": {"post": op(
            "First phase of a multi-server end: keep the reward, wait for commit", tag, EPISODE,
            operation_id="prepareEpisode", parameters=params,
            body=json_body(PrepareRequest.openapi_body()),
            responses={"200": answer("prepared", prepared), **errors(*end_errors)})},
        f"{e}/commit": {"post": op(
            "Second phase: a prepared episode goes to the pool (a repeated commit answers the same)", tag, EPISODE,
            operation_id="commitEpisode", parameters=params,
            responses={"200": answer("finished", ref("EpisodeResult")), **errors(401, 403, 404, 409, 410, 503)})},
        f"{e}/demonstration": {"post": op(
            "Record a demonstrated conversation; its assistant turns train with a supervised loss", tag, EPISODE,
            operation_id="demonstration", parameters=params, body=json_body(DemonstrationRequest.openapi_body()),
            responses={"201": answer("recorded", obj({"episode_id": string(), "tokens": integer(0),
                                                      "trained_tokens": integer(0)}, ("tokens", "trained_tokens"))),
                       **errors(400, 401, 403, 404, 409, 410)})},
        f"{e}/timelines": {"get": op(
            "The episode's timelines (one per model call and choice)", tag, EPISODE_OR_ADMIN,
            operation_id="episodeTimelines", parameters=params,
            responses={"200": answer("the timelines", timelines), **errors(401, 403, 404)})},
        "/api/v1/clients/ready": {"post": op(
            "A client's vote for the batching policy (C4/C5)", tag, CLIENT, operation_id="clientReady",
            parameters=[CLIENT_HEADER, CLIENT_KEY_HEADER],
            body=json_body(ReadyRequest.openapi_body()),
            description="Speaks for the client id of X-Swarm-Client (or client_id) only with the key that holds it: "
                        "the first vote or heartbeat of an id binds it to X-Swarm-Client-Key or to a fresh key, "
                        "answered as client_key; another key is a 403 client_key_mismatch.",
            responses={"200": answer("the vote", obj({"client_id": string(), "ready": BOOL, "client_key": string()},
                                                     ("client_id", "ready"))), **errors(400, 401, 403, 422)})},
        "/api/v1/clients/heartbeat": {"post": op(
            "A client is alive (active for batching)", tag, CLIENT, operation_id="clientHeartbeat",
            parameters=[{**CLIENT_HEADER, "required": True, "schema": string(min_length=1, max_length=128)},
                        CLIENT_KEY_HEADER],
            body=json_body(HeartbeatRequest.openapi_body(), required=False),
            responses={"200": answer("alive", obj({"client_id": string(), "state": string(), "client_key": string()},
                                                  ("client_id", "state"))), **errors(400, 401, 403, 422)})},
    }


def _meta_paths() -> dict[str, Schema]:
    return {
        "/": {"get": op("The server's name and state", "meta", PUBLIC, operation_id="root",
                        responses={"200": answer("who this is", obj({"name": string(), "state": string(),
                                                                     "openai_base_url": string(), "docs": string()},
                                                                    ("name", "state")))})},
        "/openapi.json": {"get": op("This document", "meta", PUBLIC, operation_id="openapi",
                                    responses={"200": answer("the OpenAPI description")})},
    }


_DOCUMENT: Schema | None = None


def _html(description: str, headers: dict[str, Schema] | None = None) -> Schema:
    out: Schema = {"description": description, "content": {"text/html": {"schema": string()}}}
    if headers:
        out["headers"] = headers
    return out


def _dashboard_paths() -> dict[str, Schema]:
    tag = "dashboard"
    unauthorized = {"401": {"description": "no admin token and no live session (or a wrong token)",
                            "content": {"application/json": {"schema": ref("Error")}}}}
    see_other = {"303": {"description": "back to /dashboard", "headers": {
        "Location": {"schema": string()}, "Set-Cookie": {"schema": string()}}}}
    filters = [param(name, "query", schema, description=text) for name, schema, text in (
        ("task", string(), "a substring of the task id"), ("role", string(), "a role the episode played"),
        ("client", string(), "a substring of the client id"), ("status", string(), "running, finished, aborted, ..."),
        ("kind", string(), "train or eval"), ("adapter", string(), "the LoRA adapter it sampled with (model.adapters)"),
        ("min_reward", number(), "least reward"),
        ("max_reward", number(), "greatest reward"), ("limit", integer(0, 10**9), "at most this many (200)"))]
    return {
        "/metrics": {"get": op(
            "Prometheus metrics (text format 0.0.4): state, pool, episodes, tokens, step and request durations",
            tag, DASHBOARD, operation_id="prometheus_metrics",
            responses={"200": {"description": "the metrics", "content": {"text/plain": {"schema": string()}}},
                       **unauthorized, **errors()})},
        "/dashboard": {"get": op(
            "The dashboard page when signed in, else its login form", tag, PUBLIC, operation_id="dashboard",
            responses={"200": _html("the page or the login form"), **errors()})},
        "/dashboard/login": {"post": op(
            "Log in with the admin token: sets the session cookie", tag, PUBLIC, operation_id="dashboard_login",
            body={"required": True, "content": {"application/x-www-form-urlencoded": {
                "schema": obj({"token": string("the admin token")}, ("token",))}}},
            responses={**see_other, "400": _html("the login form again: the form could not be read"),
                       "401": _html("the login form again: not the admin token"),
                       "429": _html("the login form again: too many wrong tokens from this address (or from all) "
                                    "in the last minute; see Retry-After"), **errors()})},
        "/dashboard/logout": {"post": op(
            "End the session", tag, PUBLIC, operation_id="dashboard_logout", responses={**see_other, **errors()})},
        "/dashboard/static/{name}": {"get": op(
            "The page's script or style", tag, DASHBOARD, operation_id="dashboard_static",
            parameters=[param("name", "path", string(enum=["app.js", "app.css"]))],
            responses={"200": {"description": "the file", "content": {
                "text/javascript": {"schema": string()}, "text/css": {"schema": string()}}},
                **unauthorized, **errors(404)})},
        "/api/v1/dashboard/overview": {"get": op(
            "Status, state spans, running episodes, clients and the metrics rows after the first `after`",
            tag, DASHBOARD, operation_id="dashboard_overview",
            parameters=[param("after", "query", integer(0, 10**9), description="metrics rows the caller has")],
            responses={"200": answer("the overview", obj({
                "now": number(), "status": ANY_OBJECT, "states": array(ANY_OBJECT), "running": array(ANY_OBJECT),
                "pool_tasks": array(ANY_OBJECT), "clients": array(ANY_OBJECT), "metrics": obj({"total": integer(), "rows": array(ANY_OBJECT)})},
                ("now", "status", "states", "running", "clients", "metrics"))), **unauthorized, **errors(422)})},
        "/api/v1/dashboard/episodes": {"get": op(
            "Running and recently ended episodes, newest first, filtered", tag, DASHBOARD,
            operation_id="dashboard_episodes", parameters=filters,
            responses={"200": answer("the rows", obj({"episodes": array(ANY_OBJECT), "total": integer(),
                                                      "adapters": array(string())},
                                                     ("episodes", "total"))), **unauthorized, **errors(422)})},
        "/api/v1/dashboard/episodes/{episode_id}": {"get": op(
            "One episode token by token ([text, id, logprob, trained] per token) and its training samples",
            tag, DASHBOARD, operation_id="dashboard_episode", parameters=[EPISODE_ID],
            responses={"200": answer("the episode", obj({
                "episode": ANY_OBJECT, "match": string(), "timelines": array(ANY_OBJECT),
                "samples": array(ANY_OBJECT)}, ("episode", "match", "timelines", "samples"))),
                **unauthorized, **errors(404)})},
    }


def openapi_document() -> Schema:
    """The OpenAPI 3.1 document of a swarm server (a new dict each call)."""
    global _DOCUMENT
    if _DOCUMENT is None:
        _DOCUMENT = {
            "openapi": "3.1.0",
            "info": {
                "title": "swarmkit swarm server",
                "version": __version__,
                "description": "Controller, episode and inference API of one swarm server. Errors have OpenAI's "
                               "shape (Anthropic's under /v1/messages). The prose reference is "
                               "docs/server_api.md.",
            },
            "servers": [{"url": "/"}],
            "tags": [{"name": "controller", "description": "admin token"},
                     {"name": "episodes", "description": "sampling clients: register, end, read, vote"},
                     {"name": "inference", "description": "OpenAI and Anthropic protocols, with an episode key"},
                     {"name": "meta", "description": "public"},
                     {"name": "dashboard", "description": "the web dashboard: admin token or its login session"}],
            "paths": {**_meta_paths(), **_controller_paths(), **_episode_paths(), **_inference_paths(),
                      **_dashboard_paths()},
            "components": _components(),
        }
    return copy.deepcopy(_DOCUMENT)
