"""Thinking models: the reasoning split (whole and streamed), and a Qwen3-style template
(``builtin:qwen3_think``: reasoning kept only after the last user query) through the three
protocols against a real server (scripted backend): reasoning answered apart
(``reasoning_content``, ``thinking`` blocks, ``reasoning`` items) and accepted back, timelines
that keep every generated token, the tool loop merged into one sample, and the turns the
template strips replayed with the model's own answer tokens (merge rate and drift measured)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmkit.timelines.reasoning import ReasoningStreamSplitter, opens_reasoning, split_reasoning

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from swarmkit.client import SwarmClient  # noqa: E402
from swarmkit.timelines.merging import drifted_blocks, merge  # noqa: E402

TOKEN = "reasoning-admin-token-" + "x" * 16
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
THINK_CALL = "<think>\nI should call the tool.\n</think>\n\n" + CALL
THINK_ANSWER = "<think>\nThe tool said 5.\n</think>\n\nThe answer is 5."
THINK_AGAIN = "<think>\nStill the same.\n</think>\n\nStill 5."
TOOL = {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}


# --------------------------------------------------------------------------- the split
@pytest.mark.parametrize("text,started,want", [
    ("<think>\nR\n</think>\n\nA", False, ("R", "A")),
    ("  <think>R</think>A", False, ("R", "A")),
    ("plain answer", False, (None, "plain answer")),
    ("no <think> at the start</think>", False, (None, "no <think> at the start</think>")),
    ("<think>\ncut short", False, ("cut short", "")),
    ("R\n</think>\n\nA", True, ("R", "A")),
    ("<think>\n\n</think>\n\nA", False, ("", "A")),
])
def test_split_reasoning(text, started, want):
    assert split_reasoning(text, started=started) == want


def test_a_generation_prompt_that_opens_think():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n") and not opens_reasoning("<|im_start|>assistant\n")


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([THINK_CALL, THINK_ANSWER, "plain text", "  <think>\n\nR\n\n</think>\n\n\nA\n", "<think>x</thi",
                        "<thin", "<think>\nR</think>", " hello <think>"]), st.booleans(), st.data())
def test_the_stream_splitter_equals_the_split_for_any_chunking(text, started, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    splitter = ReasoningStreamSplitter(started=started)
    reasoning, answer = [], []
    for c in chunks:
        r, a = splitter.feed(c)
        reasoning.append(r)
        answer.append(a)
    r, a = splitter.finish()
    want_r, want_a = split_reasoning(text, started=started)
    assert ("".join([*reasoning, r]), "".join([*answer, a])) == (want_r or "", want_a)
    assert splitter.reasoned == (want_r is not None)


# --------------------------------------------------------------------------- through the server
def script(prompt: str) -> str:
    last_user = prompt.rsplit("<|im_start|>user", 1)[-1]
    if "again" in last_user:
        return THINK_AGAIN
    if "<tool_response>" in last_user:
        return THINK_ANSWER
    return THINK_CALL


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    from swarmkit.apps.serve import start_server_thread
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.plugins import get_registry
    from swarmkit.testing.scripted import ScriptedBackend

    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, replies=lambda ids: script(tok.decode(ids)))
    config = validate_config(compose(["model=tiny", "model.chat_template=builtin:qwen3_think"]), get_registry())
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("reasoning"))}},
                            config=config, backend_factory=lambda cfg: backend, train=False)
    client = SwarmClient(h.url, token=TOKEN, retry_for=10)
    client.start()
    client.wait_for_state("ROLLING", timeout=30)
    yield client, tok
    client.close()
    h.stop()


def _check_merges(tls, tok):
    """The tool loop (turns 1-2) is one sample; turn 3's history lost the reasoning (the template
    drops it before the last user query), so under the token match it is a sample of its own, its
    history the model's own answer tokens. The text match (whose history text keeps what was
    generated) merges all three into one sample over two drifted blocks: what it trades away."""
    assert [tok.decode(tl.blocks[-1].token_ids) for tl in tls] == [
        THINK_CALL + "<|im_end|>", THINK_ANSWER + "<|im_end|>", THINK_AGAIN + "<|im_end|>"]
    result = merge(tls, "token")
    assert result.absorbed_into == [1, None, None] and drifted_blocks(tls, result) == 0
    by_text = merge(tls, "text")
    assert len(by_text.survivors) == 1 and drifted_blocks(tls, by_text) == 2
    answer = tok.encode("The answer is 5.<|im_end|>", add_special_tokens=False)
    assert tls[1].blocks[-1].token_ids[-len(answer):] == answer
    history = [b for b in tls[2].blocks if b.author == "history"]
    assert history[-1].token_ids == answer  # replayed: the generated answer tokens, reasoning left out
    assert "I should call" not in tok.decode(tls[2].token_ids())  # the template dropped both reasonings
    assert "The tool said" not in tok.decode(tls[2].token_ids())


def test_chat_answers_reasoning_content_and_replays_the_answer(swarm):
    client, tok = swarm
    with client.episode("think-chat") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        messages = [{"role": "user", "content": "add 2 and 3"}]
        r1 = llm.chat.completions.create(model="m", messages=messages, tools=[TOOL]).choices[0].message
        assert r1.reasoning_content == "I should call the tool." and r1.content is None and r1.tool_calls
        messages += [r1.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": r1.tool_calls[0].id, "content": "5"}]
        stream = llm.chat.completions.create(model="m", messages=messages, tools=[TOOL], stream=True)
        reasoning, content = [], []
        for chunk in stream:
            for c in chunk.choices:
                reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
                content.append(c.delta.content or "")
        assert ("".join(reasoning), "".join(content)) == ("The tool said 5.", "The answer is 5.")
        messages += [{"role": "assistant", "content": "The answer is 5."}, {"role": "user", "content": "again?"}]
        r3 = llm.chat.completions.create(model="m", messages=messages, tools=[TOOL]).choices[0].message
        assert (r3.reasoning_content, r3.content) == ("Still the same.", "Still 5.")
        ep.report(1.0)
        _check_merges(ep.timelines(as_objects=True), tok)


def test_messages_answer_thinking_blocks_and_take_them_back(swarm):
    client, tok = swarm
    with client.episode("think-messages") as ep:
        llm = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
        tool = {"name": "calculator", "description": "Evaluate arithmetic.",
                "input_schema": TOOL["function"]["parameters"]}
        messages = [{"role": "user", "content": "add 2 and 3"}]
        r1 = llm.messages.create(model="m", max_tokens=128, messages=messages, tools=[tool])
        assert [b.type for b in r1.content] == ["thinking", "tool_use"]
        assert r1.content[0].thinking == "I should call the tool."
        use = r1.content[1]
        messages += [{"role": "assistant", "content": r1.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}]}]
        with llm.messages.stream(model="m", max_tokens=128, messages=messages, tools=[tool]) as s:
            r2 = s.get_final_message()
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r2.content] == [
            ("thinking", "The tool said 5."), ("text", "The answer is 5.")]
        messages += [{"role": "assistant", "content": r2.content}, {"role": "user", "content": "again?"}]
        r3 = llm.messages.create(model="m", max_tokens=128, messages=messages, tools=[tool])
        assert [b.type for b in r3.content] == ["thinking", "text"] and r3.content[1].text == "Still 5."
        ep.report(1.0)
        _check_merges(ep.timelines(as_objects=True), tok)


def test_responses_answer_reasoning_items_and_take_them_back(swarm):
    client, tok = swarm
    tool = {"type": "function", **TOOL["function"]}
    with client.episode("think-responses") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        items: list = [{"role": "user", "content": "add 2 and 3"}]
        r1 = llm.responses.create(model="m", input=items, tools=[tool])
        assert [o.type for o in r1.output] == ["reasoning", "function_call"]
        assert r1.output[0].content[0].text == "I should call the tool."
        call = r1.output[1]
        items += [o.model_dump(exclude_none=True) for o in r1.output]  # sent back whole, as the Agents SDK does
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
        events = list(llm.responses.create(model="m", input=items, tools=[tool], stream=True))
        kinds = [e.type for e in events]
        assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"
        r2 = events[-1].response
        assert [o.type for o in r2.output] == ["reasoning", "message"] and r2.output_text == "The answer is 5."
        assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
        r3 = llm.responses.create(model="m", previous_response_id=r2.id, input="again?", tools=[tool])
        assert r3.output_text == "Still 5." and r3.output[0].type == "reasoning"
        ep.report(1.0)
        _check_merges(ep.timelines(as_objects=True), tok)


def test_thinking_can_be_turned_off_through_the_template(swarm):
    """``chat_template_kwargs`` (Chat) and ``thinking: {"type": "disabled"}`` (Messages) reach the
    template: Qwen3-style, it prefills an empty think block; other kwargs sets get their own renderer."""
    client, tok = swarm
    with client.episode("think-off") as ep:
        auth = {"Authorization": f"Bearer {ep.api_key}"}
        import httpx

        r = httpx.post(f"{ep.base_url}/chat/completions", headers=auth, json={
            "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text
        llm = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
        llm.messages.create(model="m", max_tokens=32, messages=[{"role": "user", "content": "hi"}],
                            thinking={"type": "disabled"})
        llm.messages.create(model="m", max_tokens=32, messages=[{"role": "user", "content": "hi"}])
        bad = httpx.post(f"{ep.base_url}/chat/completions", headers=auth, json={
            "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
        ep.report(0.0)
        prompts = [tok.decode([t for b in tl.blocks[:-1] for t in b.token_ids]) for tl in ep.timelines(as_objects=True)]
    empty = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert [p.endswith(empty) for p in prompts] == [True, True, False]
