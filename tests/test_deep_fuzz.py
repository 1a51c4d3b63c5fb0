"""Deep fuzz (issue 31): requests that pass validation, carrying extreme values, reach the engine.

The shallow sweep (``test_fuzz_endpoints.py``) sends random bodies, most of which are refused at
validation. Here every body is built from what each route accepts, with the extremes pushed: temperatures
of 0, 5e-324, 1e-45 and 2; ``top_p`` down to 1e-300; ``top_k``, ``min_p``, both penalties and
``repetition_penalty`` at their bounds; ``logit_bias`` of +-100; 64-bit seeds; ``n`` up to 3; stop strings of
any text; logprobs and top logprobs; streamed and not; any Unicode in messages. A real uvicorn server on
127.0.0.1 runs the ``hf`` engine with the tiny model. Every answer must be a 2xx or a 4xx (never a 5xx, never
an error event in a stream), at least 95% must be 2xx (the bodies are valid), and the server must still serve
afterwards. Examples are derandomized: the same requests every run.
"""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmkit.client import SwarmClient

pytestmark = pytest.mark.slow

TOKEN = "deep-fuzz-admin-token-" + "x" * 8
#: examples per route (about 5,500 requests in all)
EXAMPLES = {k: int(v * float(__import__("os").environ.get("SWARMKIT_FUZZ_SCALE", "1"))) for k, v in
            {"chat": 1400, "completions": 1200, "messages": 1100, "responses": 1100, "tokenize": 700}.items()}
SEEN: Counter[str] = Counter()

texts = st.text(st.characters(codec="utf-8"), min_size=1, max_size=24)
temperatures = st.one_of(st.sampled_from([0.0, 5e-324, 1e-45, 1e-6, 1e-5, 2.0]), st.floats(0, 2))
top_ps = st.one_of(st.sampled_from([1e-300, 1e-9, 1.0]), st.floats(1e-6, 1))
seeds = st.one_of(st.sampled_from([-(2**63), 2**63 - 1, 0]), st.integers(-(2**63), 2**63 - 1))
stops = st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=3), max_size=2)


def _bias(vocab: int):
    return st.dictionaries(st.integers(0, vocab - 1).map(str), st.sampled_from([-100.0, 100.0, 0.5]), max_size=3)


def chat_messages():
    turn = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]), "content": texts})
    return st.tuples(st.lists(turn, max_size=2), texts).map(lambda t: [*t[0], {"role": "user", "content": t[1]}])


def sampling(vocab: int, *, openai: bool = True):
    fields = {"temperature": temperatures, "top_p": top_ps, "seed": seeds, "stop": stops,
              "stream": st.booleans(), "skip_special_tokens": st.booleans()}
    if openai:
        fields |= {"top_k": st.integers(0, 500), "min_p": st.floats(0, 1), "frequency_penalty": st.floats(-2, 2),
                   "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.01, 10),
                   "logit_bias": _bias(vocab)}
    return st.fixed_dictionaries({}, optional=fields)


@pytest.fixture(scope="module")
def server(serve_tiny_hf, tmp_path_factory):
    with serve_tiny_hf(tmp_path_factory.mktemp("deep-fuzz"), TOKEN, episode_timeout_s=3600) as (h, c), \
            httpx.Client(timeout=120) as http:
        yield h, Episodes(c, http), len(h.swarm.backend.tokenizer)


class Episodes:
    """Calls go to one episode after another (an episode takes at most server.max_calls_per_episode)."""

    def __init__(self, client: SwarmClient, http: httpx.Client, calls_each: int = 500):
        self.client, self.http, self.calls_each = client, http, calls_each
        self.calls = 0
        self.ep = None

    def next(self) -> tuple[str, dict]:
        if self.ep is None or self.calls >= self.calls_each:
            self.ep = self.client.register(f"deep-fuzz-{self.calls}", timeout_s=3600)
            self.calls = 0
        self.calls += 1
        return self.ep.base_url.rstrip("/"), {"Authorization": f"Bearer {self.ep.api_key}"}


def _send(eps: Episodes, path: str, body: dict, route: str) -> None:
    """POST ``body`` to ``path`` under the current episode's base URL (``/tokenize``: the server's root)."""
    base, auth = eps.next()
    url = f"{base.removesuffix('/v1')}{path}"
    if body.get("stream"):
        with eps.http.stream("POST", url, json=body, headers=auth) as r:
            text = r.read().decode("utf-8", "replace")
    else:
        r = eps.http.post(url, json=body, headers=auth)
        text = r.text
    assert r.status_code < 500, (route, r.status_code, json.dumps(body)[:400], text[:400])
    assert "server_error" not in text and "incident" not in text, (route, json.dumps(body)[:400], text[:400])
    SEEN[f"{route} {r.status_code // 100}xx"] += 1
    if r.status_code >= 400:
        try:
            err = json.loads(text).get("error", {})
            code = err.get("code") or err.get("type") if isinstance(err, dict) else err
        except ValueError:
            code = text[:40]
        SEEN[f"{route} {r.status_code} {code}"] += 1
    SEEN[f"{route} total"] += 1


def _settings(route: str):
    return settings(max_examples=EXAMPLES[route], deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


def test_chat_completions(server):
    h, eps, vocab = server

    @_settings("chat")
    @given(msgs=chat_messages(), params=sampling(vocab), n=st.integers(1, 3), max_tokens=st.integers(1, 6),
           lp=st.one_of(st.none(), st.integers(0, 5)))
    def run(msgs, params, n, max_tokens, lp):
        body = {"messages": msgs, "max_tokens": max_tokens, **params}
        if not params.get("stream"):
            body["n"] = n
        if lp is not None:
            body |= {"logprobs": True, "top_logprobs": lp}
        _send(eps, "/v1/chat/completions", body, "chat")
    run()


def test_completions(server):
    h, eps, vocab = server

    @_settings("completions")
    @given(prompt=st.one_of(texts, st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30)),
           params=sampling(vocab), max_tokens=st.integers(1, 6), lp=st.one_of(st.none(), st.integers(0, 5)))
    def run(prompt, params, max_tokens, lp):
        body = {"prompt": prompt, "max_tokens": max_tokens, **params}
        if lp is not None:
            body["logprobs"] = lp
        _send(eps, "/v1/completions", body, "completions")
    run()


def test_messages(server):
    h, eps, vocab = server
    anthropic = st.fixed_dictionaries({}, optional={"temperature": st.one_of(st.sampled_from([0.0, 5e-324, 1.0]),
                                                                             st.floats(0, 1)),
                                                    "top_p": top_ps, "top_k": st.integers(0, 500),
                                                    "stop_sequences": stops, "stream": st.booleans(),
                                                    "system": texts})

    @_settings("messages")
    @given(msgs=st.lists(texts, min_size=1, max_size=3), params=anthropic, max_tokens=st.integers(1, 6))
    def run(msgs, params, max_tokens):
        turns = [{"role": "user" if i % 2 == len(msgs) % 2 - 1 or i == len(msgs) - 1 else "assistant", "content": m}
                 for i, m in enumerate(msgs)]
        turns[-1]["role"] = "user"
        for a, b in zip(turns, turns[1:], strict=False):
            if a["role"] == b["role"]:
                a["role"] = "assistant" if b["role"] == "user" else "user"
        if turns[0]["role"] != "user":
            turns = turns[1:] or [{"role": "user", "content": "hi"}]
        _send(eps, "/v1/messages", {"messages": turns, "max_tokens": max_tokens, **params}, "messages")
    run()


def test_responses(server):
    h, eps, vocab = server
    items = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer"]),
                                            "content": texts}), min_size=1, max_size=3)

    @_settings("responses")
    @given(inp=st.one_of(texts, items), temperature=temperatures, top_p=top_ps, stream=st.booleans(),
           max_tokens=st.integers(1, 6))
    def run(inp, temperature, top_p, stream, max_tokens):
        body = {"input": inp, "temperature": temperature, "top_p": top_p, "stream": stream,
                "max_output_tokens": max_tokens, "store": False}
        _send(eps, "/v1/responses", body, "responses")
    run()


def test_tokenize(server):
    h, eps, vocab = server

    @_settings("tokenize")
    @given(body=st.one_of(st.fixed_dictionaries({"prompt": texts}), st.fixed_dictionaries({"messages": chat_messages()})))
    def run(body):
        _send(eps, "/tokenize", body, "tokenize")
    run()


def test_every_route_answered_and_the_server_still_serves(server):
    h, eps, vocab = server
    total = sum(v for k, v in SEEN.items() if k.endswith("total"))
    ok = sum(v for k, v in SEEN.items() if k.endswith("2xx"))
    print(dict(SEEN))
    assert total >= 5000 * float(__import__("os").environ.get("SWARMKIT_FUZZ_SCALE", "1")), dict(SEEN)
    assert ok >= 0.95 * total, dict(SEEN)
    assert httpx.get(f"{h.url}/api/v1/health").status_code == 200
    base, auth = eps.next()
    r = eps.http.post(f"{base}/chat/completions", headers=auth,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200, r.text[:300]
