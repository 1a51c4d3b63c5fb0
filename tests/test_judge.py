"""The judge helper (``swarmkit.client.judge``): verdicts from a scripted judge model behind a real server
(``ScriptedBackend``: its reply is a function of the prompt), RULER-style ranking of a group, the cache,
retries of unusable answers and of transient HTTP failures, and the budget."""

from __future__ import annotations

import json

import httpx
import pytest

from swarmkit.client.judge import (
    RANK_PROMPT,
    Judge,
    JudgeBudgetExceeded,
    JudgeError,
    parse_json_object,
    render_episode,
)


def _judge_script(tokenizer, flaky: list[int] | None = None):
    """A judge that reads the prompt: each trajectory containing '42' scores 1, others 0.2."""
    def reply(prompt_ids):
        text = tokenizer.decode(prompt_ids)
        if flaky is not None and flaky[0] > 0:
            flaky[0] -= 1
            return "I think it is good."  # no JSON: the judge is asked again
        if "Trajectory 1:" in text:
            parts = text.split("Trajectory ")[1:]
            scores = [{"id": i + 1, "reason": "checked", "score": 1.0 if "42" in p else 0.2}
                      for i, p in enumerate(parts)]
            return "```json\n" + json.dumps({"scores": scores}) + "\n```"
        return json.dumps({"reason": "fine", "score": 1.0 if "42" in text.split("Trajectory:")[-1] else 0.2})
    return reply


def _judge(h, **kw):
    ep = h.register(task_id="judge", eval=True)  # a swarm server as judge: an eval episode's key
    return Judge("http://127.0.0.1:8000/v1", ep["api_key"], http=h.tc, **kw)


def test_a_judge_scores_an_episode_and_caches_the_verdict(make, tokenizer):
    h = make()
    h.backend.replies = _judge_script(tokenizer)
    judge = _judge(h)
    v = judge.score("What is 6 x 7?", [{"role": "user", "content": "What is 6 x 7?"},
                                        {"role": "assistant", "content": "42"}])
    assert (v.score, v.reason, v.cached) == (1.0, "fine", False)
    assert judge.score("What is 6 x 7?", "assistant: 41").score == pytest.approx(0.2)
    calls = h.backend.calls
    again = judge.score("What is 6 x 7?", "assistant: 41")
    assert again.cached and again.score == pytest.approx(0.2) and h.backend.calls == calls
    assert judge.stats["cache_hits"] == 1 and judge.stats["calls"] == 2 and judge.stats["tokens"] > 0


def test_a_judge_ranks_a_group_in_one_call_and_retries_an_unusable_answer(make, tokenizer, tmp_path):
    h = make()
    flaky = [1]
    h.backend.replies = _judge_script(tokenizer, flaky)
    judge = _judge(h, cache_path=tmp_path / "verdicts.jsonl")
    group = ["assistant: 40", "assistant: the answer is 42", "assistant: I do not know"]
    verdicts = judge.rank("What is 6 x 7?", group)
    assert [v.score for v in verdicts] == pytest.approx([0.2, 1.0, 0.2])
    assert judge.stats["retries"] == 1 and judge.stats["calls"] == 2 and flaky == [0]
    prompt = tokenizer.decode(h.backend.prompts[-1])
    assert "3 attempts" in prompt and "Trajectory 3:" in prompt
    # a restarted client reads the verdict from the cache file: no call
    again = Judge("http://127.0.0.1:8000/v1", "unused", http=h.tc, cache_path=tmp_path / "verdicts.jsonl")
    assert [v.score for v in again.rank("What is 6 x 7?", group)] == pytest.approx([0.2, 1.0, 0.2])
    assert again.stats["calls"] == 0 and all(v.cached for v in again.rank("What is 6 x 7?", group))


def test_a_judge_stops_at_its_budget_and_names_what_it_cannot_use(make, tokenizer):
    h = make()
    h.backend.replies = _judge_script(tokenizer)
    judge = _judge(h, max_calls=1)
    judge.score("t", "assistant: 42")
    with pytest.raises(JudgeBudgetExceeded, match="1 calls"):
        judge.score("t", "assistant: 7")
    h.backend.replies = lambda ids: "no verdict here"
    with pytest.raises(JudgeError, match="no usable verdict in 2 attempt"):
        _judge(h, retries=2).score("t", "assistant: 9")
    refused = Judge("http://127.0.0.1:8000/v1", "sk-wrong", http=h.tc)
    with pytest.raises(JudgeError, match="refused the request: HTTP 401"):
        refused.score("t", "x")


def test_a_judge_retries_transient_failures():
    seen = []

    def answer(request):
        seen.append(request)
        if len(seen) == 1:
            return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"choices": [{"message": {"content": '{"score": 0.7}'}}],
                                         "usage": {"total_tokens": 12}})

    judge = Judge("http://judge/v1", http=httpx.Client(transport=httpx.MockTransport(answer)), max_tokens=100)
    assert judge.score("t", "e").score == pytest.approx(0.7)
    assert judge.stats == {"calls": 2, "tokens": 12, "cache_hits": 0, "retries": 1}


def test_prompt_helpers():
    assert parse_json_object('sure: ```json\n{"score": 1}\n``` done') == {"score": 1}
    assert parse_json_object("no json {here") is None
    text = render_episode([{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": None,
                            "tool_calls": [{"function": {"name": "calc", "arguments": '{"x": 1}'}}]}])
    assert text == 'user: hi\nassistant:\n  -> calc({"x": 1})'
    assert "{n}" in RANK_PROMPT
