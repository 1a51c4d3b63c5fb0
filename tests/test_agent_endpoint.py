"""The chat endpoint as agent frameworks use it: content parts, null content, the developer
role, template errors, tool_choice, parallel_tool_calls, and generated turns replayed as
generated (token-exact timelines that merge across tool turns whatever the template or the
framework does to the tool-call JSON)."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from swarmkit.chat_templates import SMOLLM2_TOOLS_TEMPLATE
from swarmkit.timelines import Timeline
from swarmkit.timelines.merging import merge_timelines

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]

# SmolLM2-Instruct's own template: no tools, '+ message['content']' fails on null content
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_HEAD = ("{%- if tools %}{{- '<|im_start|>system\n# Tools\n' }}{{- tools | tojson }}{{- '<|im_end|>\n' }}{%- endif %}"
         "{%- for message in messages %}"
         "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\n' }}{{- message.content or '' }}"
         "{%- for tc in message.tool_calls or [] %}{%- set f = tc.function %}")
_TAIL = ("{%- endfor %}{{- '<|im_end|>\n' }}"
         "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' + message.content + "
         "'\n</tool_response><|im_end|>\n' }}"
         "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
         "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
#: three ways real templates write a tool call back
TEMPLATES = {
    # Qwen2.5: `arguments | tojson` even when arguments is a JSON string (double-encoded)
    "qwen2.5": _HEAD + "{{- '<tool_call>\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}{{- f.arguments | tojson }}"
                       "{{- '}\n</tool_call>' }}" + _TAIL,
    # Qwen3: a string verbatim, an object as JSON
    "qwen3": _HEAD + "{{- '<tool_call>\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
                     "{%- if f.arguments is string %}{{- f.arguments }}{%- else %}{{- f.arguments | tojson }}{%- endif %}"
                     "{{- '}\n</tool_call>' }}" + _TAIL,
    # Hermes-2-Pro-like: the whole call as one JSON object, arguments first
    "hermes": _HEAD + "{{- '<tool_call>\n' }}{{- {'arguments': f.arguments, 'name': f.name} | tojson }}"
                      "{{- '\n</tool_call>' }}" + _TAIL,
}


def _config(train_cfg, template: str | None = None):
    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    if template is not None:
        cfg.model.chat_template = template
    return cfg


def _reserialise(arguments: str, how: str) -> str:
    obj = json.loads(arguments)
    if how == "spaced":
        return json.dumps(obj, indent=2)
    if how == "compact":
        return json.dumps(obj, separators=(",", ":"))
    if how == "reordered":
        return json.dumps(dict(reversed(list(obj.items()))))
    return arguments


def _timelines(h, ep):
    r = h.tc.get(f"/api/v1/episodes/{ep['episode_id']}/timelines", headers={"Authorization": f"Bearer {ep['api_key']}"})
    return [Timeline.from_dict(t) for t in r.json()["timelines"]]


# --------------------------------------------------------------------------- messages
def test_text_content_parts_are_joined_and_equal_a_string(make, train_cfg):
    h = make(config=_config(train_cfg, "builtin:smollm2_tools"))
    ep = h.register()
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 + 2?"}]
    assert h.chat(ep["api_key"], messages=[{"role": "user", "content": parts}]).status_code == 200
    assert h.chat(ep["api_key"], messages=[{"role": "user", "content": "What is 2 + 2?"}]).status_code == 200
    assert h.backend.prompts[0] == h.backend.prompts[1]


def test_non_text_parts_get_a_400_naming_the_part(make):
    h = make()
    ep = h.register()
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    r = h.chat(ep["api_key"], messages=[{"role": "user", "content": parts}])
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1].type" and "image_url" in err["message"]


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, SMOLLM2_TOOLS_TEMPLATE])
def test_null_content_with_tool_calls_renders(make, train_cfg, template):
    h = make(config=_config(train_cfg, template))
    ep = h.register()
    history = [{"role": "user", "content": "Add 2 and 3."},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_x", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
               {"role": "tool", "tool_call_id": "call_x", "content": "5"}]
    r = h.chat(ep["api_key"], messages=history)
    assert r.status_code == 200, r.text


def test_null_content_is_refused_for_a_user_message(make):
    h = make()
    r = h.chat(h.register()["api_key"], messages=[{"role": "user", "content": None}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"


def test_developer_becomes_system_when_the_template_has_no_developer_role(make):
    h = make()
    key = h.register()["api_key"]
    for role in ("developer", "system"):
        assert h.chat(key, messages=[{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]).status_code == 200
    assert h.backend.prompts[0] == h.backend.prompts[1]
    assert "Be brief." in h.srv.renderer.decode(h.backend.prompts[0])


def test_template_errors_name_the_message_and_the_reason(make, train_cfg):
    strict = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
              "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
              "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    h = make(config=_config(train_cfg, strict))
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}]
    r = h.chat(h.register()["api_key"], messages=msgs)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[2]" and "roles must alternate" in err["message"], err


def test_tools_that_the_template_ignores_are_refused(make, train_cfg):
    h = make(config=_config(train_cfg, SMOLLM2_TEMPLATE))
    r = h.chat(h.register()["api_key"], tools=TOOLS)
    assert r.status_code == 400 and r.json()["error"]["code"] == "tools_unsupported"
    assert "model.chat_template" in r.json()["error"]["message"]


def test_the_shipped_smollm2_template_renders_tools(make, train_cfg):
    h = make(config=_config(train_cfg, "builtin:smollm2_tools"))
    assert h.chat(h.register()["api_key"], tools=TOOLS).status_code == 200
    assert '"name": "calculator"' in h.srv.renderer.decode(h.backend.prompts[-1])


# --------------------------------------------------------------------------- tool_choice
@pytest.mark.parametrize("template", ["builtin:tiny", "builtin:smollm2_tools"])
def test_tool_choice_named_prefills_the_call_and_never_trains_the_prefill(make, train_cfg, template):
    h = make(replies=('{"expression": "6*7"}}</tool_call>',), config=_config(train_cfg, template))
    ep = h.register()
    r = h.chat(ep["api_key"], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "calculator"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == {"expression": "6*7"}
    prefix = h.srv.renderer.tool_call_prefix("calculator")
    assert h.srv.renderer.decode(h.backend.prompts[-1]).endswith(prefix)
    (tl,) = _timelines(h, ep)
    last = tl.blocks[-1]
    n_forced = len(h.srv.renderer.encode(prefix))
    assert last.text.startswith(prefix) and last.loss_mask[:n_forced] == [0] * n_forced
    assert all(last.loss_mask[n_forced:])


def test_tool_choice_required_prefills_the_opening(make):
    h = make(replies=('lookup", "arguments": {}}</tool_call>',))
    r = h.chat(h.register()["api_key"], tools=TOOLS, tool_choice="required")
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup"


@pytest.mark.parametrize("bad,param", [({"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                       ("sometimes", "tool_choice")])
def test_bad_tool_choice_is_a_400(make, bad, param):
    h = make()
    r = h.chat(h.register()["api_key"], tools=TOOLS, tool_choice=bad)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_required_without_tools_is_a_400(make):
    h = make()
    assert h.chat(h.register()["api_key"], tool_choice="required").status_code == 400


TWO_CALLS = ('<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
             '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>')


def streamed_calls(chunks: list[dict]) -> list[dict]:
    """The tool calls of SSE chunks, accumulated as OpenAI clients do: by ``index``, the first piece
    giving ``id`` and ``name``, the ``arguments`` pieces concatenated."""
    calls: dict[int, dict] = {}
    for ch in chunks:
        for choice in ch["choices"]:
            for piece in choice["delta"].get("tool_calls", []):
                call = calls.setdefault(piece["index"], {"id": None, "type": "function",
                                                         "function": {"name": None, "arguments": ""}})
                call["id"] = piece.get("id") or call["id"]
                f = piece.get("function", {})
                call["function"]["name"] = f.get("name") or call["function"]["name"]
                call["function"]["arguments"] += f.get("arguments") or ""
    return [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_stops_after_the_first_call(make, stream):
    h = make(replies=(TWO_CALLS,))
    key = h.register()["api_key"]
    assert len(h.chat(key, tools=TOOLS).json()["choices"][0]["message"]["tool_calls"]) == 2
    if not stream:
        msg = h.chat(key, tools=TOOLS, parallel_tool_calls=False).json()["choices"][0]["message"]
        calls = msg["tool_calls"]
    else:
        r = h.chat(key, tools=TOOLS, parallel_tool_calls=False, stream=True)
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        calls = streamed_calls(chunks)
    assert [c["function"]["name"] for c in calls] == ["calculator"]


# --------------------------------------------------------------------------- replay
CALL_REPLY = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%d*%d", "precision": 0}}\n</tool_call>'


def _tool_episode(h, turns: int, how: str, keep_ids: bool, stream: bool = False):
    """An agent loop as frameworks run it: the history goes back as JSON, re-serialised ``how``."""
    ep = h.register()
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "Multiply."}]
    for k in range(turns + 1):
        r = h.chat(ep["api_key"], messages=messages, tools=TOOLS, stream=stream)
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
            content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            msg = {"role": "assistant", "content": content or None, "tool_calls": streamed_calls(chunks)}
        else:
            msg = r.json()["choices"][0]["message"]
        if not msg.get("tool_calls"):
            break
        back = {"role": "assistant", "content": None, "tool_calls": []}
        for j, c in enumerate(msg["tool_calls"]):
            back["tool_calls"].append({"id": c["id"] if keep_ids else f"fw_{k}_{j}", "type": "function",
                                       "function": {"name": c["function"]["name"],
                                                    "arguments": _reserialise(c["function"]["arguments"], how)}})
        messages.append(back)
        for c in back["tool_calls"]:
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": str(7 * (k + 1))})
    return ep


@pytest.mark.parametrize("style", sorted(TEMPLATES))
@pytest.mark.parametrize("how", ["as-sent", "spaced", "compact", "reordered"])
@pytest.mark.parametrize("keep_ids", [True, False], ids=["same-ids", "new-ids"])
def test_tool_turns_replay_as_generated_and_merge_into_one_sample(make, train_cfg, style, how, keep_ids):
    n = 3
    replies = [CALL_REPLY % (k + 2, k + 3) for k in range(n)] + ["<answer>42</answer>"]
    h = make(replies=replies, config=_config(train_cfg, TEMPLATES[style]))
    ep = _tool_episode(h, n, how, keep_ids)
    tls = _timelines(h, ep)
    assert len(tls) == n + 1
    # every generated turn is in the last prompt with the model's own tokens
    last = tls[-1]
    for tl in tls[:-1]:
        gen = tl.blocks[-1]
        assert any(b.token_ids == gen.token_ids for b in last.blocks[:-1]), "a tool turn was re-tokenized"
    assert len(merge_timelines(tls, "none")) == n + 1  # the ablation: every call its own sample
    for match in ("token", "text"):
        merged = merge_timelines(tls, match)
        assert len(merged) == 1, f"{style}/{how}: {len(merged)} samples with {match} match"
        trained = sum(sum(b.loss_mask) for b in merged[0].blocks)
        assert trained == sum(len(tl.blocks[-1].token_ids) for tl in tls)


def test_replay_works_for_streamed_turns(make, train_cfg):
    replies = [CALL_REPLY % (2, 3), "<answer>6</answer>"]
    h = make(replies=replies, config=_config(train_cfg, TEMPLATES["qwen2.5"]))
    ep = _tool_episode(h, 1, "compact", keep_ids=True, stream=True)
    assert len(merge_timelines(_timelines(h, ep), "token")) == 1


@pytest.mark.parametrize("match", ["token", "text"])
def test_a_turn_cut_at_max_tokens_merges_with_the_next(make, train_cfg, match):
    """The template closes a truncated turn with an end-of-turn token the model never generated:
    the replayed generation is a block of its own, so it still matches the llm block it repeats."""
    h = make(replies=("one two three four five six", "done"), config=_config(train_cfg))
    ep = h.register()
    messages = [{"role": "user", "content": "Count."}]
    first = h.chat(ep["api_key"], messages=messages, max_tokens=3).json()["choices"][0]
    assert first["finish_reason"] == "length"
    messages += [first["message"], {"role": "user", "content": "Go on."}]
    assert h.chat(ep["api_key"], messages=messages).status_code == 200
    tls = _timelines(h, ep)
    history = next(b for b in tls[1].blocks if b.author == "history")
    assert history.token_ids == tls[0].blocks[-1].token_ids and history.text == tls[0].blocks[-1].text
    assert len(merge_timelines(tls, match)) == 1


def test_without_replay_a_double_encoding_template_would_break_the_merge(make, train_cfg):
    """The failure replay fixes: the Qwen2.5-style render of the JSON differs from what was generated."""
    h = make(replies=[CALL_REPLY % (2, 3)], config=_config(train_cfg, TEMPLATES["qwen2.5"]))
    r = h.chat(h.register()["api_key"], tools=TOOLS)
    msg = r.json()["choices"][0]["message"]
    rendered = h.srv.renderer.render_text([{"role": "user", "content": "x"}, msg], add_generation_prompt=False)
    assert CALL_REPLY % (2, 3) not in rendered and '\\"expression\\"' in rendered


def test_a_turn_of_another_episode_is_not_replayed(make, train_cfg):
    h = make(replies=[CALL_REPLY % (2, 3), "done"], config=_config(train_cfg, TEMPLATES["qwen3"]))
    a, b = h.register(), h.register()
    msg = h.chat(a["api_key"], tools=TOOLS).json()["choices"][0]["message"]
    history = [{"role": "user", "content": "x"}, msg, {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"], "content": "6"}]
    assert h.chat(b["api_key"], messages=history, tools=TOOLS).status_code == 200
    ep_b = h.srv.episodes.get(b["episode_id"])
    assert ep_b.turns.stats["replayed"] == 0


# --------------------------------------------------------------------------- fields the server cannot honour
@pytest.mark.parametrize("field,value", [("response_format", {"type": "json_object"}), ("logit_bias", {"5": 10}),
                                         ("frequency_penalty", 0.5), ("presence_penalty", -1.0),
                                         ("functions", [{"name": "f"}]), ("best_of", 3)])
def test_a_field_that_would_change_the_generation_is_refused(make, field, value):
    h = make()
    r = h.chat(h.register()["api_key"], **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_field"


def test_no_op_values_of_unsupported_fields_are_accepted(make):
    """What SDKs send by default (LangChain sends penalties of 0, some send response_format text)."""
    h = make()
    r = h.chat(h.register()["api_key"], response_format={"type": "text"}, logit_bias={}, frequency_penalty=0,
               presence_penalty=0.0, n=1, stream=False, user="someone", metadata={"a": "b"})
    assert r.status_code == 200, r.text


def test_the_strict_flag_never_changes_the_prompt(make):
    """The Agents SDK sends ``strict: false``, CrewAI ``strict: true`` (checked after generation,
    tests/test_answer_consistency.py): neither reaches the template."""
    h = make()
    key = h.register()["api_key"]
    for value in (False, True):
        flagged = [{**t, "function": {**t["function"], "strict": value}} for t in TOOLS]
        assert h.chat(key, tools=flagged).status_code == 200
    assert h.chat(key, tools=TOOLS).status_code == 200
    assert h.backend.prompts[0] == h.backend.prompts[1] == h.backend.prompts[2]
