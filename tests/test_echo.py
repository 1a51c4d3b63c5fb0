"""``/v1/completions`` with ``echo``: prompt logprobs that any swarm server can serve as a teacher or judge.

The hf engine's prompt logprobs equal a direct full-sequence forward of the same model (a real uvicorn server
on 127.0.0.1, the tiny model); a scoring call (``max_tokens: 0``) is never recorded, a generation beside the
echo is; an engine that cannot score prompts refuses ``echo`` with ``logprobs`` clearly.
"""

from __future__ import annotations

import httpx
import pytest

from swarmkit.testing.scripted import LOGPROB, ScriptedBackend

TOKEN = "echo-admin-token-" + "x" * 16


@pytest.fixture(scope="module")
def hf_server(serve_tiny_hf, tmp_path_factory):
    with serve_tiny_hf(tmp_path_factory.mktemp("echo"), TOKEN) as served:
        yield served


def _direct_logprobs(ids: list[int]) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """log p(ids[i] | ids[:i]) for i >= 1 and the top 3 at each position, from a plain transformers forward."""
    import torch
    from transformers import AutoModelForCausalLM

    from swarmkit.models import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path("builtin:tiny"), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    lps = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))]
    vals, idx = logp[:-1].topk(3, -1)
    tops = [list(zip(i, v, strict=True)) for i, v in zip(idx.tolist(), vals.tolist(), strict=True)]
    return lps, tops


def test_echo_prompt_logprobs_equal_a_direct_forward_and_are_not_recorded(hf_server):
    h, client = hf_server
    tok = h.swarm.backend.tokenizer
    ids = list(tok.encode("The quick brown fox jumps over the lazy dog, twice.", add_special_tokens=False))
    want, want_tops = _direct_logprobs(ids)
    with client.episode("echo") as ep:
        auth = {"Authorization": f"Bearer {ep.api_key}"}
        r = httpx.post(f"{ep.base_url}/completions", headers=auth, timeout=60,
                       json={"prompt": ids, "echo": True, "max_tokens": 0, "logprobs": 3})
        assert r.status_code == 200, r.text[:300]
        body = r.json()
        (choice,) = body["choices"]
        lp = choice["logprobs"]
        assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        got = lp["token_logprobs"][1:]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-4
        for pos, alts in enumerate(lp["top_logprobs"][1:]):  # keyed by token text: two ids may share one
            assert max(alts.values()) == pytest.approx(want_tops[pos][0][1], abs=1e-4)
            assert all(min(abs(v - w) for _, w in want_tops[pos]) < 1e-4 for v in alts.values())
        assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        # a text prompt and a batch of prompts score the same way
        r2 = httpx.post(f"{ep.base_url}/completions", headers=auth, timeout=60,
                        json={"prompt": [ids[:5], ids], "echo": True, "max_tokens": 0, "logprobs": 0})
        c0, c1 = r2.json()["choices"]
        assert c1["logprobs"]["token_logprobs"][1:] == pytest.approx(got, abs=1e-5)
        assert c0["logprobs"]["token_logprobs"][1:] == pytest.approx(want[:4], abs=1e-4)
        assert c1["logprobs"]["top_logprobs"] is None
        assert ep.timelines() == []  # scoring is not a sample of the policy
        # echo beside a generation: the text and logprobs start with the prompt's, the generation is recorded
        r3 = httpx.post(f"{ep.base_url}/completions", headers=auth, timeout=60,
                        json={"prompt": ids, "echo": True, "max_tokens": 4, "logprobs": 0, "temperature": 0})
        c = r3.json()["choices"][0]
        assert c["text"].startswith(tok.decode(ids)) and len(c["logprobs"]["tokens"]) > len(ids)
        assert c["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(want, abs=1e-4)
        (recorded,) = ep.timelines()
        assert recorded["blocks"][-1]["token_ids"] and recorded["blocks"][0]["token_ids"] == ids
        ep.abort("test")


def test_echo_on_an_engine_without_prompt_scoring_is_refused_and_echo_without_logprobs_is_not(make):
    class NoScoring(ScriptedBackend):
        scores_prompts = False

    h = make(replies=("ok",))
    ep = h.register()
    auth = {"Authorization": f"Bearer {ep['api_key']}"}
    r = h.tc.post("/v1/completions", headers=auth, json={"prompt": "hello world", "echo": True, "max_tokens": 0,
                                                          "logprobs": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["token_logprobs"][1:] == \
        [LOGPROB] * (len(r.json()["choices"][0]["logprobs"]["tokens"]) - 1)
    h.srv.inference.backend.__class__ = NoScoring
    r = h.tc.post("/v1/completions", headers=auth, json={"prompt": "hello world", "echo": True, "max_tokens": 0,
                                                          "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo" and "cannot compute" in r.text
    r = h.tc.post("/v1/completions", headers=auth, json={"prompt": "hello world", "echo": True, "max_tokens": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello world"
    r = h.tc.post("/v1/completions", headers=auth, json={"prompt": "hello world", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_alternatives_sharing_a_text_keep_the_most_likely():
    """Two ids that decode to one text (partial UTF-8 bytes: both U+FFFD) must not hide the best
    alternative of a Completions ``top_logprobs`` row, whatever order the engine lists them in."""
    from swarmkit.server.routes.openai import completion_logprobs, top_by_text

    def tt(i):
        return ("\ufffd" if i in (1, 2) else f"t{i}"), None

    assert top_by_text(tt, {1: -1.0, 2: -2.0, 3: -3.0}) == {"\ufffd": -1.0, "t3": -3.0}
    assert top_by_text(tt, {3: -3.0, 2: -2.0, 1: -1.0}) == {"\ufffd": -1.0, "t3": -3.0}
    lp = completion_logprobs(tt, [3], [-3.0], [{1: -1.0, 2: -2.0, 3: -3.0}])
    assert lp["top_logprobs"] == [{"\ufffd": -1.0, "t3": -3.0}]
