"""The server's HTTP API in process (Starlette TestClient), with a scripted zero-compute backend."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from swarmkit.errors import ConfigError
from swarmkit.swarm.auth import resolve_admin_token
from swarmkit.testing.scripted import LOGPROB

TOOL_REPLY = 'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def assert_error(r, status, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err
    if code:
        assert err["code"] == code, err


# --------------------------------------------------------------------------- controller
ADMIN_ROUTES = [("GET", "/api/v1/status"), ("POST", "/api/v1/admin/configure"), ("POST", "/api/v1/admin/start"),
                ("POST", "/api/v1/admin/stop"), ("POST", "/api/v1/admin/restart"),
                ("POST", "/api/v1/admin/checkpoint"), ("GET", "/api/v1/episodes")]


@pytest.mark.parametrize("method,path", ADMIN_ROUTES)
def test_controller_routes_need_the_admin_token(make, method, path):
    h = make(start=False)
    assert_error(h.tc.request(method, path), 401, None)
    assert_error(h.tc.request(method, path, headers={"Authorization": "Bearer nope"}), 403, "wrong_admin_token")
    assert h.srv.state.state == "OFFLINE"


def test_health_needs_no_token_and_status_reports_progress(make):
    h = make(accept_hook=False)
    assert h.tc.get("/api/v1/health").json()["state"] == "ROLLING"
    ep = h.register()
    h.chat(ep["api_key"])
    st = h.tc.get("/api/v1/status", headers=h.admin).json()
    assert st["state"] == "ROLLING" and st["global_step"] == 0
    assert st["episodes"]["running"] == 1 and st["calls"] == 1
    assert st["pool"] == {"episodes": 0, "tasks": 0}
    h.report(ep, 1.0)
    assert h.tc.get("/api/v1/status", headers=h.admin).json()["pool"] == {"episodes": 1, "tasks": 1}


def test_start_without_a_config_is_409(make):
    h = make(start=False, config=None)
    assert_error(h.tc.post("/api/v1/admin/start", headers=h.admin), 409, "not_configured")


def test_configure_by_overrides_dict_and_yaml(make):
    h = make(start=False, config=None)
    r = h.tc.post("/api/v1/admin/configure", headers=h.admin,
                  json={"overrides": ["model=tiny", "batching.batch_size=3"]})
    assert r.status_code == 200, r.text
    assert r.json()["config"]["batching"]["batch_size"] == 3 and r.json()["config"]["mode"] == "server"
    r = h.tc.post("/api/v1/admin/configure", headers=h.admin,
                  json={"config": {"model": {"path": "builtin:tiny"}, "backend": {"name": "hf", "device": "cpu"}}})
    assert r.status_code == 200, r.text
    assert r.json()["config"]["model"]["path"] == "builtin:tiny"
    assert r.json()["config"]["server"]["run_dir"] == h.srv.server_cfg.run_dir
    r = h.tc.post("/api/v1/admin/configure", headers=h.admin, json={"yaml": "model:\n  path: builtin:tiny\n"})
    assert r.status_code == 200, r.text
    assert h.srv.config.model.path == "builtin:tiny"


def test_configure_lists_every_problem(make):
    h = make(start=False, config=None)
    r = h.tc.post("/api/v1/admin/configure", headers=h.admin,
                  json={"config": {"model": {"pathh": "x"}, "backend": {"name": "hf", "dtype": 3.5, "bogus": 1}}})
    assert_error(r, 422, "invalid_config")
    msg = r.json()["error"]["message"]
    assert "model.pathh" in msg and "backend.bogus" in msg
    assert_error(h.tc.post("/api/v1/admin/configure", headers=h.admin, json={"overrides": ["backend=nope"]}),
                 422, "invalid_config")
    assert_error(h.tc.post("/api/v1/admin/configure", headers=h.admin, json={}), 422, "missing_field")
    # the overrides form lists every problem too (no Hydra "Could not override ... use +optim.lrr" advice)
    r = h.tc.post("/api/v1/admin/configure", headers=h.admin,
                  json={"overrides": ["optim.lrr=1", "model.pathh=x", "optim.lr=abc"]})
    assert_error(r, 422, "invalid_config")
    msg = r.json()["error"]["message"]
    assert "3 problem(s)" in msg and "optim.lrr: unknown key" in msg and "model.pathh: unknown key" in msg
    assert "optim.lr:" in msg and "+optim.lrr" not in msg
    assert h.srv.config is None


def test_stop_aborts_running_episodes_and_restart_boots_again(make):
    h = make()
    ep = h.register()
    r = h.tc.post("/api/v1/admin/stop", headers=h.admin)
    assert r.json()["state"] == "OFFLINE"
    assert_error(h.chat(ep["api_key"]), 409, "episode_already_ended")
    assert_error(h.tc.post("/api/v1/episodes", json={"task_id": "t"}), 503, "server_offline")
    assert h.tc.post("/api/v1/admin/restart", headers=h.admin).status_code == 202
    for _ in range(200):
        if h.srv.state.state == "ROLLING":
            break
        time.sleep(0.01)
    assert h.register()["episode_id"]


def test_boot_failure_falls_back_to_offline_with_the_error(make, train_cfg):
    h = make(start=False)
    h.srv.backend_factory = lambda cfg: (_ for _ in ()).throw(OSError("no such model"))
    h.tc.post("/api/v1/admin/start", headers=h.admin)
    for _ in range(200):
        if h.srv.state.state == "OFFLINE":
            break
        time.sleep(0.01)
    st = h.tc.get("/api/v1/status", headers=h.admin).json()
    assert st["state"] == "OFFLINE" and "no such model" in st["last_error"]


def test_checkpoint_writes_config_and_status(make, tmp_path):
    h = make()
    r = h.tc.post("/api/v1/admin/checkpoint", headers=h.admin)
    assert r.status_code == 200, r.text
    folder = r.json()["path"]
    assert json.load(open(os.path.join(folder, "config.json")))["model"]["path"] == "builtin:tiny"
    assert os.path.exists(os.path.join(folder, "status.json"))


def test_admin_token_precedence_and_private_file(tmp_path, monkeypatch):
    assert resolve_admin_token("from-config-0123456", tmp_path) == ("from-config-0123456", "config")
    monkeypatch.setenv("SWARMKIT_ADMIN_TOKEN", "from-env-0123456789")
    assert resolve_admin_token(None, tmp_path) == ("from-env-0123456789", "env")
    # issue 31: a one-character admin token was accepted
    for short in ("x", "fifteen-chars-x"):
        with pytest.raises(ConfigError, match="at least 16"):
            resolve_admin_token(short, tmp_path)
    monkeypatch.delenv("SWARMKIT_ADMIN_TOKEN")
    token, where = resolve_admin_token(None, tmp_path)
    assert where == str(tmp_path / "admin_token") and len(token) >= 32
    assert stat.S_IMODE(os.stat(where).st_mode) == 0o600
    assert open(where).read().strip() == token
    assert resolve_admin_token(None, tmp_path)[0] != token


# --------------------------------------------------------------------------- episodes
def test_keys_are_random_and_reach_only_their_own_episode(make):
    h = make()
    a, b = h.register(task_id="a"), h.register(task_id="b")
    assert a["api_key"] != b["api_key"] and len(a["api_key"]) >= 40
    assert a["episode_id"] not in a["api_key"] and a["base_url"] == "http://127.0.0.1:8000/v1"
    assert_error(h.report(b, 1.0, key=a["api_key"]), 403, "wrong_episode_key")
    assert_error(h.tc.get(f"/api/v1/episodes/{b['episode_id']}/timelines",
                          headers={"Authorization": f"Bearer {a['api_key']}"}), 403)
    assert h.chat(a["api_key"]).status_code == 200
    tl_b = h.tc.get(f"/api/v1/episodes/{b['episode_id']}/timelines",
                    headers={"Authorization": f"Bearer {b['api_key']}"}).json()["timelines"]
    assert tl_b == []
    admin_view = h.tc.get(f"/api/v1/episodes/{a['episode_id']}/timelines", headers=h.admin)
    assert len(admin_view.json()["timelines"]) == 1


def test_finished_training_episode_reaches_the_pool_hook_eval_and_aborted_do_not(make):
    h = make()
    train, ev, ab = h.register(task_id="t"), h.register(task_id="t", eval=True), h.register(task_id="t")
    for ep in (train, ev, ab):
        assert h.chat(ep["api_key"]).status_code == 200
    assert h.report(train, 0.5).json()["accepted"] is True
    assert h.report(ev, 1.0).json()["accepted"] is False
    r = h.tc.post(f"/api/v1/episodes/{ab['episode_id']}/abort", json={"reason": "env crashed"},
                  headers={"Authorization": f"Bearer {ab['api_key']}"})
    assert r.json() == {"episode_id": ab["episode_id"], "status": "aborted", "reason": "env crashed"}
    assert [e.id for e in h.accepted] == [train["episode_id"]]
    got = h.accepted[0]
    assert got.reward == 0.5 and len(got.timelines) == 1 and got.task_id == "t"
    st = h.tc.get("/api/v1/status", headers=h.admin).json()["episodes"]
    assert (st["finished"], st["eval_finished"], st["aborted"]) == (1, 1, 1)


def test_pool_failure_answers_503_and_the_report_can_be_retried(make):
    calls = []

    def flaky(ep):
        calls.append(ep.id)
        if len(calls) == 1:
            raise OSError("disk full")

    h = make(accept_hook=flaky)
    ep = h.register()
    r = h.report(ep, 1.0)
    assert_error(r, 503, "pool_unavailable")
    assert "Retry-After" in r.headers
    assert h.report(ep, 1.0).json()["accepted"] is True
    assert calls == [ep["episode_id"]] * 2


def test_async_pool_hook_is_awaited_before_the_answer(make):
    stored = []

    async def hook(ep):
        stored.append(ep.id)

    h = make(accept_hook=hook)
    ep = h.register()
    h.report(ep, 1.0)
    assert stored == [ep["episode_id"]]


def test_roles_get_their_own_keys_and_label_their_timelines(make):
    h = make()
    ep = h.register(task_id="werewolf", roles=["wolf", "seer"])
    assert set(ep["keys"]) == {"wolf", "seer"} and ep["api_key"] == ep["keys"]["wolf"]
    h.chat(ep["keys"]["wolf"])
    h.chat(ep["keys"]["seer"])
    h.chat(ep["keys"]["seer"])
    assert_error(h.report(ep, {"wolf": 1.0}), 422, "invalid_reward")
    assert_error(h.report(ep, {"wolf": 1.0, "seer": 0.0, "villager": 1.0}), 422, "invalid_reward")
    r = h.report(ep, {"wolf": 1.0, "seer": 0.0}, key=ep["keys"]["seer"])
    assert r.json()["rewards"] == {"wolf": 1.0, "seer": 0.0}
    tls = h.tc.get(f"/api/v1/episodes/{ep['episode_id']}/timelines",
                   headers={"Authorization": f"Bearer {ep['api_key']}"}).json()["timelines"]
    assert [t["role"] for t in tls] == ["wolf", "seer", "seer"]
    assert h.accepted[0].rewards == {"wolf": 1.0, "seer": 0.0}


def test_per_role_reward_needs_roles(make):
    h = make()
    assert_error(h.report(h.register(), {"a": 1.0}), 422, "invalid_reward")


def test_rewards_too_large_to_train_on_are_refused(make):
    """Two rewards of 1e308 overflow a GRPO group's sum (NaN weights): a bound (422); a 401-digit integer
    is refused at the door (400: no request integer may exceed 20 digits)."""
    h = make()
    ep = h.register(roles=["a", "b"])
    for bad in (1e308, -1e7, {"a": 1.0, "b": 1e308}):
        r = h.report(ep, bad)
        assert_error(r, 422, "invalid_reward")
        assert "max_abs_reward" in r.json()["error"]["message"]
    r = h.tc.post(f"/api/v1/episodes/{ep['episode_id']}/report", content=b'{"reward": 1' + b"0" * 400 + b"}",
                  headers={"Authorization": f"Bearer {ep['api_key']}", "Content-Type": "application/json"})
    assert_error(r, 400, "invalid_json")
    assert "401 digits" in r.json()["error"]["message"]
    assert h.report(ep, 1e6).status_code == 200


def test_abandoned_episode_is_reaped_after_deadline(make):
    h = make()
    ep = h.register(timeout_s=0.15)
    time.sleep(0.4)
    st = h.tc.get(f"/api/v1/episodes/{ep['episode_id']}", headers=h.admin).json()
    assert st["status"] == "aborted" and st["abort_reason"] == "deadline"
    assert_error(h.chat(ep["api_key"]), 410, "episode_expired")
    assert_error(h.report(ep, 1.0), 410, "episode_expired")
    assert h.accepted == []
    assert h.tc.get("/api/v1/status", headers=h.admin).json()["episodes"]["reaped"] == 1


def test_rolling_post_refuses_new_episodes_but_running_ones_finish(make):
    h = make()
    ep = h.register()
    h.call(h.srv.enter_rolling_post)
    r = h.tc.post("/api/v1/episodes", json={"task_id": "t"})
    assert_error(r, 503, "server_busy")
    assert int(r.headers["Retry-After"]) >= 1
    assert h.chat(ep["api_key"]).status_code == 200
    assert h.report(ep, 1.0).status_code == 200
    h.call(h.srv.enter_weight_syncing)
    assert_error(h.tc.post("/api/v1/episodes", json={"task_id": "t"}), 503, "server_busy")
    h.srv.cycle.global_step = 1  # the test plays the cycle: it moves the step on, then resumes
    h.call(h.srv.resume_rolling)
    assert h.register()["episode_id"]
    assert h.tc.get("/api/v1/health").json()["global_step"] == 1


def test_call_during_weight_sync_waits_for_the_new_weights(make):
    import threading

    h = make()
    ep = h.register()
    h.call(h.srv.enter_rolling_post)
    h.call(h.srv.enter_weight_syncing)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("r", h.chat(ep["api_key"])))
    t.start()
    time.sleep(0.2)
    assert "r" not in result
    h.srv.cycle.global_step = 1  # the test plays the cycle: it moves the step on, then resumes
    h.call(h.srv.resume_rolling)
    t.join(5)
    assert result["r"].status_code == 200


def test_drain_aborts_episodes_left_at_the_deadline(make):
    h = make()
    ep = h.register()
    h.call(h.srv.enter_rolling_post)

    async def drain():
        return await h.srv.drain(0.1)

    assert h.call(drain) == 1
    assert h.tc.get(f"/api/v1/episodes/{ep['episode_id']}", headers=h.admin).json()["abort_reason"] == \
        "drain deadline"


def test_client_ready_votes_are_tracked(make):
    h = make()
    r = h.tc.post("/api/v1/clients/ready", json={"ready": True}, headers={"X-Swarm-Client": "c1"})
    assert r.json()["client_id"] == "c1" and r.json()["ready"] is True and r.json()["client_key"]  # the id's key
    assert h.srv.clients.active()["c1"].ready is True
    assert h.tc.get("/api/v1/status", headers=h.admin).json()["clients"] == {"active": 1, "ready": 1}
    assert_error(h.tc.post("/api/v1/clients/ready", json={"ready": True}), 422, "missing_field")


# --------------------------------------------------------------------------- OpenAI endpoints
def test_chat_completion_parses_tool_calls_and_records_the_call(make, tokenizer):
    h = make(replies=[TOOL_REPLY])
    ep = h.register()
    r = h.chat(ep["api_key"], tools=TOOLS, logprobs=True, top_logprobs=1)
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    call = choice["message"]["tool_calls"][0]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert all(t["logprob"] == LOGPROB and len(t["top_logprobs"]) == 1 for t in choice["logprobs"]["content"])
    tl = h.srv.episodes.get(ep["episode_id"]).timelines[0]
    prompt_ids = [t for b in tl.blocks[:-1] for t in b.token_ids]
    expected = tokenizer.apply_chat_template(MSGS, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    assert prompt_ids == list(expected) == h.backend.prompts[-1]
    assert tl.blocks[-1].author == "llm" and tl.blocks[-1].loss_mask == [1] * len(tl.blocks[-1].token_ids)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == len(tl.blocks[-1].token_ids)


def test_tool_calls_are_left_as_text_without_tools(make):
    h = make(replies=[TOOL_REPLY])
    ep = h.register()
    choice = h.chat(ep["api_key"]).json()["choices"][0]
    assert choice["message"]["content"] == TOOL_REPLY and "tool_calls" not in choice["message"]
    choice = h.chat(ep["api_key"], tools=TOOLS, tool_choice="none").json()["choices"][0]
    assert choice["message"]["content"] == TOOL_REPLY


def sse_events(text: str) -> list:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_streamed_chat_sends_deltas_tool_calls_and_usage(make):
    h = make(replies=[TOOL_REPLY])
    ep = h.register()
    r = h.chat(ep["api_key"], tools=TOOLS, stream=True, stream_options={"include_usage": True}, logprobs=True)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content.strip() == "Checking."
    calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["index"] == 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    usage = events[-2]["usage"]
    tl = h.srv.episodes.get(ep["episode_id"]).timelines[0]
    assert usage["completion_tokens"] == len(tl.blocks[-1].token_ids) > 5
    assert tl.meta["stream"] is True and tl.meta["complete"] is True
    lps = [t["logprob"] for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert lps == tl.blocks[-1].logprobs


def test_n_choices_each_become_a_timeline_and_can_stream(make):
    h = make(replies=["one two", "three four"])
    ep = h.register()
    body = h.chat(ep["api_key"], n=2).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    events = sse_events(h.chat(ep["api_key"], n=3, stream=True).text)
    finishes = {c["choices"][0]["index"] for c in events[:-1] if c["choices"][0]["finish_reason"]}
    assert finishes == {0, 1, 2}
    assert len(h.srv.episodes.get(ep["episode_id"]).timelines) == 5


def test_stop_strings_and_max_tokens_are_honoured(make):
    h = make(replies=["alpha beta. gamma delta"])
    ep = h.register()
    c = h.chat(ep["api_key"], stop=["."]).json()["choices"][0]
    assert c["message"]["content"] == "alpha beta" and c["finish_reason"] == "stop"
    c = h.chat(ep["api_key"], max_tokens=3).json()["choices"][0]
    assert c["finish_reason"] == "length"
    assert len(h.srv.episodes.get(ep["episode_id"]).timelines[-1].blocks[-1].token_ids) == 3


def test_prompt_over_the_context_is_400(make, train_cfg):
    h = make()
    ep = h.register()
    r = h.chat(ep["api_key"], messages=[{"role": "user", "content": "word " * 3000}])
    assert_error(r, 400, "context_length_exceeded")


def test_text_completions_from_text_and_token_ids(make, tokenizer):
    h = make(replies=["xyz"])
    ep = h.register()
    key = {"Authorization": f"Bearer {ep['api_key']}"}
    r = h.tc.post("/v1/completions", json={"model": "m", "prompt": "hello", "logprobs": 1}, headers=key).json()
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == "xyz"
    assert r["choices"][0]["logprobs"]["token_logprobs"][0] == LOGPROB
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    r = h.tc.post("/v1/completions", json={"model": "m", "prompt": ids}, headers=key).json()
    assert r["usage"]["prompt_tokens"] == len(ids)
    events = sse_events(h.tc.post("/v1/completions", json={"prompt": "hi", "stream": True}, headers=key).text)
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == "xyz"
    tls = h.srv.episodes.get(ep["episode_id"]).timelines
    assert len(tls) == 3 and tls[1].blocks[0].token_ids == ids and tls[1].blocks[0].author == "user"
    events = sse_events(h.tc.post("/v1/completions", json={"prompt": ids, "stream": True, "stream_options": {
        "include_usage": True}}, headers=key).text)
    generated = len(h.srv.episodes.get(ep["episode_id"]).timelines[-1].blocks[-1].token_ids)
    assert events[-2] == {**events[-2], "choices": [], "usage": {
        "prompt_tokens": len(ids), "completion_tokens": generated, "total_tokens": len(ids) + generated}}


def test_text_completions_come_back_as_generated_and_are_not_kept_for_replay(make):
    """A raw prompt takes the shared turn path minus what only a chat turn has: no reasoning split, no
    tool call lifted out, nothing remembered for replay."""
    reply = 'hm <think>x</think> ok <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    h = make(replies=[reply])
    ep = h.register()
    key = {"Authorization": f"Bearer {ep['api_key']}"}
    r = h.tc.post("/v1/completions", json={"prompt": "<think>", "max_tokens": 200}, headers=key).json()
    assert r["choices"][0]["text"] == reply and r["choices"][0]["finish_reason"] == "stop"
    events = sse_events(h.tc.post("/v1/completions", json={"prompt": "<think>", "max_tokens": 200, "stream": True},
                                  headers=key).text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == reply
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    episode = h.srv.episodes.get(ep["episode_id"])
    assert [t.meta["endpoint"] for t in episode.timelines] == ["completions", "completions"]
    assert episode.turns.turns == []


def test_models_lists_the_served_model_for_a_valid_key(make):
    h = make()
    ep = h.register()
    assert_error(h.tc.get("/v1/models"), 401, "missing_api_key")
    body = h.tc.get("/v1/models", headers={"Authorization": f"Bearer {ep['api_key']}"}).json()
    assert body["object"] == "list" and body["data"][0]["id"] == "tiny-qwen2"


def test_agent_messages_are_never_rewritten(make):
    h = make()
    ep = h.register()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    sent = json.loads(json.dumps(msgs))
    h.chat(ep["api_key"], messages=msgs)
    text = "".join(b.text for b in h.srv.episodes.get(ep["episode_id"]).timelines[0].blocks[:-1])
    assert text.count("system") == 1 and msgs == sent


# --------------------------------------------------------------------------- bad input sweep
NAN_BODY = b'{"reward": NaN}'
INF_BODY = b'{"reward": Infinity}'


def bad_requests(ep, other):
    key = {"Authorization": f"Bearer {ep['api_key']}"}
    eid = ep["episode_id"]
    report = f"/api/v1/episodes/{eid}/report"
    return [
        # (name, method, path, kwargs, status, code)
        ("malformed JSON chat", "POST", "/v1/chat/completions", {"content": b"{oops", "headers": key}, 400,
         "invalid_json"),
        ("JSON array chat", "POST", "/v1/chat/completions", {"content": b"[1]", "headers": key}, 400, "invalid_json"),
        ("empty body chat", "POST", "/v1/chat/completions", {"content": b"", "headers": key}, 400, "invalid_json"),
        ("no messages", "POST", "/v1/chat/completions", {"json": {"model": "m"}, "headers": key}, 400,
         "missing_field"),
        ("bad role", "POST", "/v1/chat/completions",
         {"json": {"messages": [{"role": "robot", "content": "x"}]}, "headers": key}, 400, "invalid_value"),
        ("bad temperature", "POST", "/v1/chat/completions",
         {"json": {"messages": MSGS, "temperature": "hot"}, "headers": key}, 400, "invalid_value"),
        ("n = 0", "POST", "/v1/chat/completions", {"json": {"messages": MSGS, "n": 0}, "headers": key}, 400,
         "invalid_value"),
        # issue 31: a seed past 64 bits answered 200 and then dropped the stream
        ("seed past 64 bits, streamed", "POST", "/v1/chat/completions",
         {"json": {"messages": MSGS, "seed": 2**64, "stream": True}, "headers": key}, 400, "invalid_value"),
        ("top_logprobs without logprobs", "POST", "/v1/chat/completions",
         {"json": {"messages": MSGS, "top_logprobs": 2}, "headers": key}, 400, "invalid_value"),
        ("no key", "POST", "/v1/chat/completions", {"json": {"messages": MSGS}}, 401, "missing_api_key"),
        ("wrong key", "POST", "/v1/chat/completions",
         {"json": {"messages": MSGS}, "headers": {"Authorization": "Bearer sk-swarm-guess"}}, 401,
         "invalid_api_key"),
        ("no prompt", "POST", "/v1/completions", {"json": {"model": "m"}, "headers": key}, 400, "missing_field"),
        ("bad token ids", "POST", "/v1/completions", {"json": {"prompt": [10**9]}, "headers": key}, 400,
         "invalid_value"),
        ("malformed JSON register", "POST", "/api/v1/episodes", {"content": b"{"}, 400, "invalid_json"),
        ("missing task_id", "POST", "/api/v1/episodes", {"json": {"eval": True}}, 422, "missing_field"),
        ("bad eval", "POST", "/api/v1/episodes", {"json": {"task_id": "t", "eval": "yes"}}, 422, "invalid_field"),
        ("bad timeout", "POST", "/api/v1/episodes", {"json": {"task_id": "t", "timeout_s": -1}}, 422,
         "invalid_field"),
        ("huge timeout", "POST", "/api/v1/episodes", {"json": {"task_id": "t", "timeout_s": 1e12}}, 422,
         "invalid_field"),
        ("repeated roles", "POST", "/api/v1/episodes", {"json": {"task_id": "t", "roles": ["a", "a"]}}, 422,
         "invalid_field"),
        ("oversized body", "POST", "/api/v1/episodes", {"content": b"x" * 5001}, 413, "body_too_large"),
        ("oversized chunked body", "POST", "/api/v1/episodes",
         {"content": iter([b"x" * 3000, b"x" * 3000])}, 413, "body_too_large"),
        ("NaN reward", "POST", report, {"content": NAN_BODY, "headers": key}, 422, "invalid_reward"),
        ("inf reward", "POST", report, {"content": INF_BODY, "headers": key}, 422, "invalid_reward"),
        ("string reward", "POST", report, {"json": {"reward": "1"}, "headers": key}, 422, "invalid_reward"),
        ("bool reward", "POST", report, {"json": {"reward": True}, "headers": key}, 422, "invalid_reward"),
        ("missing reward", "POST", report, {"json": {}, "headers": key}, 422, "missing_field"),
        ("report without key", "POST", report, {"json": {"reward": 1}}, 401, "missing_api_key"),
        ("report with another episode's key", "POST", report,
         {"json": {"reward": 1}, "headers": {"Authorization": f"Bearer {other['api_key']}"}}, 403,
         "wrong_episode_key"),
        ("unknown episode", "POST", "/api/v1/episodes/ep-nope/report", {"json": {"reward": 1}, "headers": key}, 404,
         "episode_not_found"),
        ("unknown episode timelines", "GET", "/api/v1/episodes/ep-nope/timelines", {"headers": key}, 404,
         "episode_not_found"),
        ("unknown route", "GET", "/v1/nothing", {}, 404, "route_not_found"),
        ("wrong method", "GET", "/v1/chat/completions", {}, 405, "method_not_allowed"),
    ]


def test_bad_input_sweep_gets_clear_4xx_and_the_server_stays_up(make):
    h = make(max_body_bytes=5000)
    ep, other = h.register(), h.register()
    for name, method, path, kwargs, status, code in bad_requests(ep, other):
        r = h.tc.request(method, path, **kwargs)
        assert r.status_code == status, f"{name}: {r.status_code} {r.text}"
        assert r.json()["error"]["code"] == code, f"{name}: {r.text}"
        assert r.json()["error"]["message"], name
    # the episode survived all of it and ends normally, once
    assert h.chat(ep["api_key"]).status_code == 200
    assert h.report(ep, 1.0).status_code == 200
    assert_error(h.report(ep, 1.0), 409, "episode_already_ended")
    assert_error(h.tc.post(f"/api/v1/episodes/{ep['episode_id']}/abort", json={},
                           headers={"Authorization": f"Bearer {ep['api_key']}"}), 409, "episode_already_ended")
    assert_error(h.chat(ep["api_key"]), 409, "episode_already_ended")
    assert h.tc.get("/api/v1/health").json()["state"] == "ROLLING"
    assert len(h.accepted) == 1


def test_pool_record_carries_what_the_pool_needs(make, tmp_path):
    from swarmkit.pool import SamplePool
    from swarmkit.swarm.cycle import pool_record

    pool = SamplePool(str(tmp_path / "journal.sqlite"))
    h = make(accept_hook=lambda ep: pool.add(pool_record(ep)))
    ep = h.register(task_id="math-7", meta={"task_family": "math"})
    h.chat(ep["api_key"])
    h.report(ep, 0.25)
    rec = pool.get(ep["episode_id"])
    assert (rec.task_id, rec.reward, rec.task_family, len(rec.timelines)) == ("math-7", 0.25, "math", 1)
    assert rec.timelines[0]["blocks"][-1]["author"] == "llm"


def test_after_the_step_limit_training_episodes_are_refused_and_late_reports_are_not_pooled(make):
    h = make()
    open_before = h.register()
    h.srv.cycle.training_finished = "training finished: trainer.total_steps=2 reached"
    r = h.tc.post("/api/v1/episodes", json={"task_id": "t2"})
    assert_error(r, 409, "training_finished")
    assert h.tc.post("/api/v1/episodes", json={"task_id": "t2", "eval": True}).status_code == 201
    answer = h.report(open_before, 1.0).json()
    assert answer["accepted"] is False and "total_steps=2" in answer["not_accepted"] and not h.accepted
    assert h.tc.get("/api/v1/status", headers=h.admin).json()["training_finished"].startswith("training finished")


def test_a_drain_aborts_an_idle_episode_at_once_and_waits_for_a_busy_one(make):
    h = make()
    t_reg = time.time()
    idle, busy_ep = h.register(task_id="idle"), h.register(task_id="busy")
    h.srv.drain_idle_s = 0.3
    busy = h.srv.episodes.get(busy_ep["episode_id"])
    busy.in_flight = 1  # a call being generated: never idle
    t0 = time.monotonic()
    aborted = h.call(h.srv.drain, 1.5)
    took = time.monotonic() - t0
    st = h.tc.get(f"/api/v1/episodes/{idle['episode_id']}", headers=h.admin).json()
    assert st["status"] == "aborted" and st["abort_reason"] == "idle at drain"
    assert st["ended"] - t_reg < 1.2  # at once, not at the end of the 1.5 s drain
    assert busy.status == "aborted" and busy.abort_reason == "drain deadline"  # waited for the whole drain
    assert aborted == 2 and 1.4 < took < 5
    busy.in_flight = 0


def test_one_address_cannot_fill_the_episode_cap_under_many_client_ids(make, train_cfg):
    """Issue 31: one caller without a client token filled the global 4,096-episode cap through four client
    ids, and every other client got 429. Client ids are self-declared; the registering address is not:
    by default one address holds at most half the cap (server.max_running_per_address)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    cfg.server.update(max_running_episodes=8, max_running_per_client=8)
    h = make(config=cfg)
    assert h.srv.max_running_per_address == 4
    answers = [h.tc.post("/api/v1/episodes", json={"task_id": "t"}, headers={"X-Swarm-Client": f"sybil-{i}"})
               for i in range(6)]
    assert [r.status_code for r in answers] == [201] * 4 + [429] * 2
    assert "max_running_per_address" in answers[-1].json()["error"]["message"]
    assert h.srv.episodes.running_count() == 4  # half the cap is left for everyone else
    h.srv.episodes.abort(h.srv.episodes.get(answers[0].json()["episode_id"]), "done")
    assert h.tc.post("/api/v1/episodes", json={"task_id": "t"}, headers={"X-Swarm-Client": "sybil-9"}).status_code == 201


def test_quotas_on_episodes_calls_tokens_and_meta(make, train_cfg):
    """Running episodes (in all, per client), calls per episode, tokens per request and meta size
    are bounded, with clear 429 / 400 / 422 answers; ending episodes frees the quota."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    cfg.server.update(max_running_episodes=3, max_running_per_client=2, max_calls_per_episode=2,
                      max_tokens_per_request=100, max_meta_bytes=200, max_running_per_address=3)
    h = make(config=cfg)
    a = [h.tc.post("/api/v1/episodes", json={"task_id": "t"}, headers={"X-Swarm-Client": "a"}) for _ in range(3)]
    assert [r.status_code for r in a] == [201, 201, 429]
    assert_error(a[2], 429, "too_many_episodes")
    assert "max_running_per_client" in a[2].json()["error"]["message"] and a[2].headers["retry-after"] == "1"
    b = h.tc.post("/api/v1/episodes", json={"task_id": "t"}, headers={"X-Swarm-Client": "b"})
    assert b.status_code == 201
    r = h.tc.post("/api/v1/episodes", json={"task_id": "t"}, headers={"X-Swarm-Client": "c"})
    assert_error(r, 429, "too_many_episodes")
    assert "max_running_episodes" in r.json()["error"]["message"]
    ep = a[0].json()
    assert h.report(ep, 1.0).status_code == 200  # ending one frees a place
    assert h.tc.post("/api/v1/episodes", json={"task_id": "t"}, headers={"X-Swarm-Client": "c"}).status_code == 201

    ep = a[1].json()
    assert_error(h.chat(ep["api_key"], max_tokens=60, n=2), 400, "too_many_tokens")
    assert h.chat(ep["api_key"], max_tokens=10).status_code == 200
    assert h.chat(ep["api_key"], max_tokens=10).status_code == 200
    assert_error(h.chat(ep["api_key"], max_tokens=10), 429, "too_many_calls")
    r = h.tc.post(f"/api/v1/episodes/{ep['episode_id']}/report", json={"reward": 1.0, "meta": {"x": "y" * 300}},
                  headers={"Authorization": f"Bearer {ep['api_key']}"})
    assert_error(r, 422, "invalid_field")
    assert "max_meta_bytes" in r.json()["error"]["message"]
    r = h.tc.post("/api/v1/episodes", json={"task_id": "t", "meta": {"x": "y" * 300}})
    assert_error(r, 422, "invalid_field")


def test_meta_that_no_reader_can_read_back_is_refused(make, train_cfg):
    """Issue 31: NaN, Infinity or ~950-deep nesting in an episode's meta made reading that episode and the
    admin episode list answer 500 for everyone while it ran."""
    h = make(train_cfg)
    ep = h.register(task_id="fine", meta={"a": [1, {"b": 2}]})
    for raw in (b'{"task_id": "t", "meta": {"x": NaN}}', b'{"task_id": "t", "meta": {"x": [Infinity]}}',
                b'{"task_id": "t", "meta": ' + b'{"a": ' * 950 + b'1' + b'}' * 950 + b'}',
                b'{"task_id": "t", "meta": ' + b'[' * 40 + b']' * 40 + b'}'):
        r = h.tc.post("/api/v1/episodes", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code in (400, 422), (raw[:60], r.status_code, r.text[:200])
    r = h.tc.post(f"/api/v1/episodes/{ep['episode_id']}/report", content=b'{"reward": 1.0, "meta": {"x": NaN}}',
                  headers={"Authorization": f"Bearer {ep['api_key']}", "Content-Type": "application/json"})
    assert_error(r, 422, "invalid_field")
    assert h.tc.get("/api/v1/episodes?ended=10", headers=h.admin).status_code == 200
    assert h.tc.get(f"/api/v1/episodes/{ep['episode_id']}", headers=h.admin).status_code == 200


def test_silent_clients_are_forgotten():
    from swarmkit.swarm.presence import ClientTracker

    t = ClientTracker(active_window_s=60)
    t.touch("old", now=0.0)
    t.touch("recent", now=1000.0)
    assert t.prune(now=1001.0) == 1 and set(t.all()) == {"recent"}


def test_public_url_is_the_base_url_handed_to_agents(make):
    h = make(public_url="https://swarm.example:8443/")
    ep = h.tc.post("/api/v1/episodes", json={"task_id": "t"}, headers={"Host": "evil.example"}).json()
    assert ep["base_url"] == "https://swarm.example:8443/v1"
    assert ep["anthropic_base_url"] == "https://swarm.example:8443"


def test_retry_after_is_sized_to_the_training_step(make):
    """During a step, a registration's 503 says how long the last step took, to the millisecond
    (X-Swarm-Retry-After-Ms; Retry-After keeps whole seconds, at least 1), and the SDK waits that."""
    import httpx

    from swarmkit.client._common import retry_after

    h = make()
    srv = h.srv
    srv.enter_rolling_post()
    r = h.tc.post("/api/v1/episodes", json={"task_id": "t"})
    assert r.headers["x-swarm-retry-after-ms"] == "1000"  # no step timed yet
    srv.enter_weight_syncing()
    time.sleep(0.12)
    srv.resume_rolling()
    srv.enter_rolling_post()
    r = h.tc.post("/api/v1/episodes", json={"task_id": "t"})
    assert_error(r, 503, "server_busy")
    ms = int(r.headers["x-swarm-retry-after-ms"])
    assert 50 <= ms <= 200 and r.headers["retry-after"] == "1"
    assert retry_after(httpx.Response(503, headers=r.headers), 1.0) == pytest.approx(ms / 1000)
    assert retry_after(httpx.Response(503, headers={"Retry-After": "3"}), 1.0) == 3.0
    srv.enter_weight_syncing()
    srv.resume_rolling()


def test_an_unexpected_error_answers_an_incident_not_the_exception(make, caplog):
    """A 500 never echoes the exception (its text can hold a prompt, a path or a key); the log has
    the traceback once per kind of error and one line per repeat (issue 18, item 9)."""

    def boom(prompt_ids):
        raise RuntimeError("secret-prompt-text /home/me/.keys")

    from swarmkit.server import errors

    errors._SEEN_ERRORS.clear()
    h = make(replies=boom)  # the test client raises whatever reaches the ASGI server: nothing must
    ep = h.register()
    with caplog.at_level("ERROR", logger="swarmkit.server"):
        answers = [h.chat(ep["api_key"]) for _ in range(3)]
    for r in answers:
        assert_error(r, 500, "internal_error")
        assert "secret" not in r.text and "incident" in r.json()["error"]["message"]
    tracebacks = [rec for rec in caplog.records if rec.exc_info]
    assert len(tracebacks) == 1 and "seen 3 times" in caplog.records[-1].getMessage()


def test_dashboard_logins_are_throttled(make, train_cfg):
    """Issue 31: the dashboard login took 1,155-1,358 guesses a second. Ten wrong tokens a minute per address
    (a hundred from all), then 429 with Retry-After; the right token still works once the window passes."""
    from swarmkit.server.dashboard.session import LoginThrottle

    h = make(train_cfg)
    for _ in range(10):
        assert h.tc.post("/dashboard/login", data={"token": "wrong-guess"}).status_code == 401
    r = h.tc.post("/dashboard/login", data={"token": "wrong-guess"})
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    r = h.tc.post("/dashboard/login", data={"token": "admin-secret-token"}, follow_redirects=False)
    assert r.status_code == 429  # no guess is checked while throttled, the right one neither
    t = LoginThrottle(per_address=2, in_all=3, window_s=10)
    t.failed("a", now=0)
    t.failed("a", now=1)
    assert t.retry_after("a", now=2) == 8 and t.retry_after("b", now=2) == 0
    t.failed("b", now=3)
    assert t.retry_after("c", now=4) == 6  # all addresses together
    assert t.retry_after("a", now=11) == 0
