"""The OpenAPI description at ``GET /openapi.json``: valid, complete, and fuzzed by schemathesis.

The schemathesis run drives a real server (uvicorn on 127.0.0.1, scripted backend, the tiny
model with a tool-aware template) through every operation of the document, with bodies,
parameters and headers generated from it: first data the document allows (positive), then
data it forbids (negative), a bounded number of examples each. Requests carry the token the
operation needs (the admin token, or the key of a live episode: a new one is registered once
the last has ended), most episode routes name that live episode, and one request in eight
carries a wrong key instead (or the Authorization header schemathesis made up). No answer may be a 5xx (schemathesis's ``not_a_server_error``),
and every answer must be one the document describes: a listed status, content type and body
schema (``status_code_conformance``, ``content_type_conformance``, ``response_schema_conformance``).
The destructive controller routes, ``stop`` and ``restart``, run last, so that they do not
turn every later request into a 503; the server must answer ``/api/v1/health`` afterwards.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from omegaconf import OmegaConf
from openapi_spec_validator import validate
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup

from swarmkit.apps.serve import start_server_thread
from swarmkit.errors import ApiError
from swarmkit.server.app import create_app
from swarmkit.server.openapi import openapi_document
from swarmkit.testing.scripted import ScriptedBackend

ADMIN_TOKEN = "openapi-test-admin-token"
#: examples per operation and generation mode (positive, negative); raise it for a deeper run
EXAMPLES = int(os.environ.get("SWARMKIT_OPENAPI_EXAMPLES", "20"))
#: no 5xx; and every answer is one the document describes (its status, content type and body schema)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
#: run last: they abort every episode and take the server through OFFLINE
DESTRUCTIVE = ("/api/v1/admin/stop", "/api/v1/admin/restart")


def _described_routes() -> set[tuple[str, str]]:
    return {(path, method.upper()) for path, item in openapi_document()["paths"].items() for method in item}


def _app_routes() -> set[tuple[str, str]]:
    out = set()
    for route in create_app().routes:
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)  # {model_id:path} -> {model_id}
        out |= {(path, m) for m in route.methods if m != "HEAD"}
    return out


def test_the_document_is_valid_openapi():
    doc = openapi_document()
    validate(doc)
    assert doc["openapi"].startswith("3.1")
    schemes = doc["components"]["securitySchemes"]
    assert {"adminToken", "episodeKey", "anthropicApiKey", "clientToken"} <= set(schemes)
    assert schemes["anthropicApiKey"] == {**schemes["anthropicApiKey"], "type": "apiKey", "in": "header",
                                          "name": "x-api-key"}


def test_every_route_of_the_app_is_described_and_nothing_else():
    app, described = _app_routes(), _described_routes()
    assert app - described == set(), f"routes without a description in swarmkit/server/openapi.py: {app - described}"
    assert described - app == set(), f"described operations with no route: {described - app}"


def test_the_document_names_what_the_routes_check():
    paths = openapi_document()["paths"]
    register = paths["/api/v1/episodes"]["post"]
    assert register["requestBody"]["content"]["application/json"]["schema"]["required"] == ["task_id"]
    assert {} in register["security"]  # open unless the server has a client token
    assert paths["/api/v1/admin/stop"]["post"]["security"] == [{"adminToken": []}]
    assert {"anthropicApiKey": []} in paths["/v1/messages"]["post"]["security"]
    messages = paths["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert messages["required"] == ["messages", "max_tokens"]
    assert paths["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AnthropicError"}
    for path in ("/", "/openapi.json", "/api/v1/health"):
        assert paths[path]["get"]["security"] == []


# --------------------------------------------------------------------------- the schemathesis run
@pytest.fixture(scope="module")
def server(train_cfg, tmp_path_factory):
    from swarmkit.models import build_tiny_tokenizer

    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    cfg.model.chat_template = "builtin:smollm2_tools"
    backend = ScriptedBackend(build_tiny_tokenizer(),
                              replies=['ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "fine"])
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": ADMIN_TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("openapi")),
                                        "episode_timeout_s": 3600}},
                            config=cfg, backend_factory=lambda c: backend, train=False)
    try:
        with httpx.Client(base_url=h.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as c:
            assert c.post("/api/v1/admin/start").status_code == 202
            end = time.monotonic() + 30
            while c.get("/api/v1/health").json()["state"] != "ROLLING":
                assert time.monotonic() < end, "the server did not reach ROLLING"
                time.sleep(0.05)
        yield h
    finally:
        h.stop()


class Live:
    """Live episodes for the run: one per episode operation, one for the inference calls."""

    def __init__(self, h: Any):
        self.h = h
        self.episodes: dict[str, dict[str, Any]] = {}
        self.response_id: str | None = None

    def episode(self, slot: str) -> dict[str, Any]:
        """The slot's episode, running (prepared for ``commit``); a new one once it has ended."""
        ep = self.episodes.get(slot)
        want = "prepared" if slot.endswith("/commit") else "running"
        if ep is not None:
            try:
                state = self.h.swarm.episodes.get(ep["episode_id"])
            except ApiError:  # ended long ago and forgotten
                state = None
            if state is not None and state.status == want and state.n_calls < 900:
                return ep
        r = httpx.post(f"{self.h.url}/api/v1/episodes", json={"task_id": f"openapi-{slot}", "timeout_s": 3600})
        assert r.status_code == 201, r.text
        ep = self.episodes[slot] = r.json()
        if want == "prepared":
            r = httpx.post(f"{self.h.url}/api/v1/episodes/{ep['episode_id']}/prepare", json={"reward": 0.5},
                           headers={"Authorization": f"Bearer {ep['api_key']}"})
            assert r.status_code == 200, r.text
        if slot == "inference":
            r = httpx.post(f"{self.h.url}/v1/responses", json={"input": "hi", "max_output_tokens": 4},
                           headers={"Authorization": f"Bearer {ep['api_key']}"})
            assert r.status_code == 200, r.text
            self.response_id = r.json()["id"]
        return ep


def _prepare(case: schemathesis.Case, live: Live, security: list[dict[str, Any]], n: int) -> None:
    """The token the operation needs; the live episode (or stored response, or model) in its path."""
    schemes = {name for req in security for name in req}
    path_params = case.path_parameters if case.path_parameters is not None else {}
    real_ids = n % 4 != 3  # one request in four keeps the generated ids
    token: str | None = None
    if "episode_id" in path_params:
        ep = live.episode(case.operation.path)
        if real_ids:
            path_params["episode_id"] = ep["episode_id"]
        token = ep["api_key"]
    elif "episodeKey" in schemes:
        ep = live.episode("inference")
        token = ep["api_key"]
        if real_ids and "response_id" in path_params and live.response_id:
            path_params["response_id"] = live.response_id
        if real_ids and "model_id" in path_params:
            path_params["model_id"] = ep["model"]
    elif "adminToken" in schemes:
        token = ADMIN_TOKEN
    headers = dict(case.headers or {})
    if n % 8 == 7:  # one in eight: the Authorization schemathesis made up (negative cases), else a wrong key
        headers.setdefault("Authorization", "Bearer sk-swarm-wrong")
    else:
        headers.pop("Authorization", None)
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
    case.headers = headers


class Run:
    """What the run saw: answers by status, failed checks, operations with nothing to break."""

    def __init__(self, url: str, live: Live):
        self.url, self.live = url, live
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []
        self.unbreakable: list[str] = []

    def fuzz(self, operation: Any, mode: GenerationMode, security: list[dict[str, Any]]) -> None:
        """``EXAMPLES`` generated requests to ``operation``, each answer checked."""

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case: schemathesis.Case) -> None:
            _prepare(case, self.live, security, sum(self.statuses.values()) + len(self.failures))
            where = f"{operation.label} ({mode.value})"
            try:
                response = case.call(base_url=self.url, timeout=60)
            except requests.RequestException as exc:  # a dropped connection is worse than a 500
                self.failures.append(f"{where}: no answer: {exc!r}\n    {case.as_curl_command()}"[:2000])
                return
            self.statuses[response.status_code] += 1
            try:
                case.validate_response(response, checks=CHECKS)
            except FailureGroup as exc:  # collected: every failing operation is reported
                self.failures.append(f"{where}: {response.status_code} {response.text[:300]}\n    "
                                     f"{case.as_curl_command()}\n    {exc}"[:2000])

        try:
            run()
        except (Unsatisfiable, schemathesis.errors.SchemathesisError):  # no parameters, no body: nothing to break
            if mode is not GenerationMode.NEGATIVE:
                raise
            self.unbreakable.append(operation.label)


@pytest.mark.slow  # about 50 s: the slow step of .ci/run keeps README's test command under 20 minutes
def test_schemathesis_finds_no_server_error(server, capsys):
    served = httpx.get(f"{server.url}/openapi.json")  # public: no token
    assert served.status_code == 200 and served.json() == openapi_document()
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = sorted((r.ok() for r in schema.get_all_operations()), key=lambda o: o.path in DESTRUCTIVE)
    doc = openapi_document()
    run = Run(server.url, Live(server))
    started = time.monotonic()
    for operation in operations:
        security = doc["paths"][operation.path][operation.method.lower()]["security"]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run.fuzz(operation, mode, security)

    sent = sum(run.statuses.values())
    server_errors = sum(n for code, n in run.statuses.items() if code >= 500)
    with capsys.disabled():
        print(f"\nschemathesis: {len(operations)} operations, {sent} requests in {time.monotonic() - started:.0f} s, "
              f"{server_errors} 5xx, {len(run.failures)} failed checks; statuses {dict(sorted(run.statuses.items()))}; "
              f"no negative cases for {', '.join(run.unbreakable) or 'none'} (nothing to break)")
    assert not run.failures, "\n".join(run.failures[:20])
    assert server_errors == 0
    tested = {(o.path, o.method.upper()) for o in operations}
    assert tested | {("/openapi.json", "GET")} == _described_routes()  # the document it was loaded from aside
    assert httpx.get(f"{server.url}/api/v1/health").status_code == 200  # still answering after stop and restart


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": True}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}),
])
def test_streamed_answers_conform_to_the_document(server, path, body):
    """Each server-sent event of a streamed answer is what the document describes (schemathesis's
    SSE check; a random fuzz case asks for a stream only now and then)."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operation = schema[path]["POST"]
    key = Live(server).episode("inference")["api_key"]
    case = operation.Case(body=body, headers={"Authorization": f"Bearer {key}"})
    response = case.call(base_url=server.url, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"][0].startswith("text/event-stream")
    case.validate_response(response, checks=CHECKS)
