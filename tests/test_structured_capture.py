"""Issue 33, two capture paths: every protocol records its calls through one path
(:mod:`swarmkit.server.turn`), so a call under constrained decoding (``response_format``) is
recorded with ``meta.structured`` whichever endpoint carried it, ``/v1/completions`` included, and
training rescores its grammar-masked logprobs (a real uvicorn server on 127.0.0.1, the hf engine
with the tiny model).

The hf engine does not constrain decoding (vLLM does, and reports the masked distribution's
logprobs); here it claims ``response_format`` so that the server lets such calls through: what is
checked is the capture path, not the grammar.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest

from swarmkit.pool.records import EpisodeRecord
from swarmkit.server import fields
from swarmkit.training.samples import build_samples
from swarmkit.training.trainer import build_algo

TOKEN = "structured-capture-admin-" + "x" * 16
JSON_OBJECT = {"type": "json_object"}


@pytest.fixture(scope="module")
def guided_server(serve_tiny_hf, tmp_path_factory):
    with serve_tiny_hf(tmp_path_factory.mktemp("structured"), TOKEN) as (h, client):
        engine = h.swarm.backend
        engine.sampling_fields = frozenset(engine.sampling_fields) | {"response_format"}
        yield h, client


def _post(ep, path: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{ep.base_url}{path}", json=body, timeout=60, headers={"Authorization": f"Bearer {ep.api_key}"})
    assert r.status_code == 200, r.text[:300]
    assert fields.IGNORED_HEADER not in r.headers, r.headers  # nothing of the request was ignored
    return r


def _streamed_text(r: httpx.Response) -> str:
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def test_completions_under_response_format_are_recorded_structured_and_rescored(guided_server):
    _, client = guided_server
    with client.episode("structured-completions") as ep:
        # distinct prompts: no timeline absorbs another when the samples are built
        plain = _post(ep, "/completions", {"prompt": "plain", "max_tokens": 4}).json()
        forced = _post(ep, "/completions", {"prompt": "json please", "max_tokens": 4,
                                            "response_format": JSON_OBJECT}).json()
        streamed = _post(ep, "/completions", {"prompt": "json streamed", "max_tokens": 4, "stream": True,
                                              "response_format": JSON_OBJECT})
        chat = _post(ep, "/chat/completions", {"messages": [{"role": "user", "content": "json chat"}],
                                               "max_tokens": 4, "response_format": JSON_OBJECT}).json()
        tls = ep.timelines(as_objects=True)
        ep.report(1.0)
    assert [t.meta["endpoint"] for t in tls] == ["completions", "completions", "completions", "chat"]
    assert [bool(t.meta.get("structured")) for t in tls] == [False, True, True, True]
    assert tls[2].meta["stream"] is True
    # the answers are the recorded tokens
    assert tls[0].blocks[-1].text == plain["choices"][0]["text"]
    assert tls[1].blocks[-1].text == forced["choices"][0]["text"]
    assert tls[2].blocks[-1].text == _streamed_text(streamed)
    assert chat["choices"][0]["message"]["content"] is not None
    # training treats the generated logprobs of every structured call as unknown (the engine rescores them)
    record = EpisodeRecord(episode_id="e", task_id="t", reward=1.0, timelines=tls, policy_version=0, meta={},
                           client_id="c")
    samples = {tuple(s.input_ids): s for s in build_samples([record], build_algo({"name": "grpo"}), "token")}
    for tl in tls:
        s = samples[tuple(tl.token_ids())]
        generated = [lp for lp, m in zip(s.old_logprobs, s.loss_mask, strict=True) if m]
        assert generated and all(math.isnan(v) for v in generated) == bool(tl.meta.get("structured")), tl.meta


def test_completions_refuse_response_format_where_the_engine_cannot_honour_it(guided_server):
    """As chat does: a 400 naming the field, never a silently unconstrained answer."""
    h, client = guided_server
    engine = h.swarm.backend
    claimed = engine.sampling_fields
    engine.sampling_fields = claimed - {"response_format"}
    try:
        with client.episode("structured-refused") as ep:
            for path, body in (("/completions", {"prompt": "json"}),
                               ("/chat/completions", {"messages": [{"role": "user", "content": "json"}]})):
                r = httpx.post(f"{ep.base_url}{path}", json={**body, "max_tokens": 2, "response_format": JSON_OBJECT},
                               timeout=60, headers={"Authorization": f"Bearer {ep.api_key}"})
                assert r.status_code == 400, r.text[:300]
                err = r.json()["error"]
                assert (err["code"], err["param"]) == ("unsupported_field", "response_format"), err
            assert ep.timelines() == []
            ep.report(0.0)
    finally:
        engine.sampling_fields = claimed


def test_an_answer_that_breaks_its_response_format_is_answered_and_reported(guided_server):
    """A grammar may let through what JSON refuses (raw control characters inside a string: 5 of 8 answers of
    vLLM 0.26 on an H100), and a token limit cuts an answer: the answer is sent as generated and the break is
    reported as a strict tool's is, in ``X-Swarm-Strict-Violations`` and the timeline's ``meta.strict_violations``
    (here the tiny model's unconstrained text, which is no JSON)."""
    _, client = guided_server
    with client.episode("structured-violations") as ep:
        chat = _post(ep, "/chat/completions", {"messages": [{"role": "user", "content": "json chat"}],
                                               "max_tokens": 4, "temperature": 0, "response_format": JSON_OBJECT})
        done = _post(ep, "/completions", {"prompt": "json please", "max_tokens": 4, "temperature": 0, "response_format": JSON_OBJECT})
        _post(ep, "/chat/completions", {"messages": [{"role": "user", "content": "json streamed"}], "max_tokens": 4,
                                        "temperature": 0, "stream": True, "response_format": JSON_OBJECT})
        tls = ep.timelines(as_objects=True)
        ep.report(0.0)
    for r in (chat, done):
        assert "response_format: the answer is not JSON" in httpx.QueryParams(
            f"v={r.headers[fields.STRICT_HEADER]}")["v"], r.headers
    assert [t.meta["strict_violations"][0].split(" (")[0] for t in tls] == ["response_format: the answer is not JSON"] * 3
