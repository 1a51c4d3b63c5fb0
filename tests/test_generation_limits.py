"""Issue 31, generation amplification: work for a request whose client is gone is cancelled, and one
request's many continuations do not hold every slot (a real uvicorn server on 127.0.0.1, the hf engine
with the tiny model)."""

from __future__ import annotations

import time

import httpx
import pytest

TOKEN = "generation-limits-admin-" + "x" * 16


@pytest.fixture(scope="module")
def hf_server(serve_tiny_hf, tmp_path_factory):
    with serve_tiny_hf(tmp_path_factory.mktemp("limits"), TOKEN) as served:
        yield served


def test_a_call_whose_client_disconnects_stops_generating(hf_server):
    h, client = hf_server
    engine = h.swarm.backend
    eos = sorted(engine._eos_ids)
    with client.episode("gone") as ep:
        body = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 1000, "n": 16,
                "logit_bias": {str(t): -100 for t in eos}}  # no end of sequence: 3,600 tokens to make
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{ep.base_url}/chat/completions", json=body, timeout=0.5,
                       headers={"Authorization": f"Bearer {ep.api_key}"})
        t0 = time.monotonic()
        while (engine._active or engine._pending) and time.monotonic() < t0 + 30:
            time.sleep(0.02)
        idle_after = time.monotonic() - t0
        steps = engine.stats["decode_steps"]
        assert not engine._active and not engine._pending, "the engine still generates for a closed connection"
        assert idle_after < 0.75, f"the engine generated {idle_after:.2f} s for a closed connection ({steps} steps)"
        made = engine.stats["tokens_generated"]
        time.sleep(0.3)
        assert engine.stats["tokens_generated"] == made
        assert sum(len(s.out_ids) for s in engine._active) == 0
        # nothing of the abandoned call was recorded; the episode goes on
        r = httpx.post(f"{ep.base_url}/chat/completions", timeout=60, headers={"Authorization": f"Bearer {ep.api_key}"},
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text[:300]
        ep.report(0.0)
