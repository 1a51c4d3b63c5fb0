"""ChatRenderer: exact token ids, the block-prefix invariant, caching, tokenizer drift."""

from __future__ import annotations

import pytest

from swarmkit.timelines import Timeline, merge
from swarmkit.timelines.render import ChatRenderer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                          "parameters": {"type": "object",
                                                         "properties": {"city": {"type": "string"}}}}}]

# SmolLM2-Instruct style ChatML: a default system prompt when the first message is not system.
SMOL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3-like: reasoning is kept only for assistant turns after the last user query.
THINK_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content or '' -%}"
    "{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\n' -}}"
    "{%- if loop.index0 > ns.last_query and reasoning -%}"
    "{{- '<think>\n' + reasoning + '\n</think>\n\n' -}}"
    "{%- endif -%}"
    "{{- content + '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def tok():
    import torch
    from transformers import AutoTokenizer

    from swarmkit.models import tiny_model_dir

    torch.set_num_threads(1)
    return AutoTokenizer.from_pretrained(tiny_model_dir())


def ref_ids(tok, messages, tools=None, template=None):
    out = tok.apply_chat_template(messages, tools=tools, chat_template=template,
                                  add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def flat(blocks):
    return [t for b in blocks for t in b.token_ids]


def gen_ids(tok, text):
    """What the model generates for ``text``: its canonical tokens plus the EOS."""
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


TURNS = [
    ("user", "What is 12 + 7?"),
    ("assistant", "The answer is <answer>19</answer>."),
    ("user", "And the weather in Paris?"),
    ("assistant_tool", '{"city": "Paris"}'),
    ("tool", "The weather in Paris is sunny, 21 degrees."),
    ("assistant", "It is sunny."),
    ("user", "thanks!"),
]


def conversation(system=True):
    msgs = [{"role": "system", "content": "You are a helpful assistant."}] if system else []
    for role, content in TURNS:
        if role == "assistant_tool":
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": content}}]})
        else:
            msgs.append({"role": role, "content": content})
    return msgs


def generated_text(message):
    if message.get("tool_calls"):
        fn = message["tool_calls"][0]["function"]
        return f'<tool_call>{{"name": "{fn["name"]}", "arguments": {fn["arguments"]}}}</tool_call>'
    return message["content"]


@pytest.mark.parametrize("system", [True, False])
@pytest.mark.parametrize("template, tools", [(None, None), (None, TOOLS), (SMOL_TEMPLATE, None),
                                             (THINK_TEMPLATE, None)], ids=["tiny", "tiny-tools", "smol", "think"])
def test_ids_equal_chat_template(tok, tools, system, template):
    r = ChatRenderer(tok, chat_template=template)
    msgs = conversation(system)
    if template is not None:  # they do not render tool_calls
        msgs = [m for m in msgs if not m.get("tool_calls") and m["role"] != "tool"]
    for n in range(1, len(msgs) + 1):
        blocks = r.render_prompt(msgs[:n], tools)
        assert flat(blocks) == ref_ids(tok, msgs[:n], tools, template), n
        assert all(b.loss_mask == [0] * len(b) and b.logprobs == [0.0] * len(b) for b in blocks)
        assert blocks[-1].author == "template"
        # a fresh renderer (no cache) gives the same blocks
        assert ChatRenderer(tok, chat_template=template).render_prompt(msgs[:n], tools) == blocks


def test_authors(tok):
    blocks = ChatRenderer(tok).render_prompt(conversation(), TOOLS)
    authors = [b.author for b in blocks]
    assert authors[:2] == ["user", "user"]
    assert "env" in authors and authors.count("history") == 3
    hist = [b for b in blocks if b.author == "history"]
    assert hist[0].text == "The answer is <answer>19</answer>.<|im_end|>"


def calls_of(tok, renderer, msgs, tools):
    """The timelines of an episode: one LLM call before each assistant message."""
    timelines = []
    for n, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = renderer.render_prompt(msgs[:n], tools)
        ids = gen_ids(tok, generated_text(m))
        timelines.append(Timeline(prompt + [renderer.completion_block(ids, [-0.25] * len(ids))]))
    final = renderer.render_prompt(msgs, tools)
    return timelines, final


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("match", ["text", "token"])
def test_prefix_invariant_and_merge(tok, tools, match):
    r = ChatRenderer(tok)
    msgs = conversation()
    timelines, _ = calls_of(tok, r, msgs, tools)
    from swarmkit.timelines import resolve_match

    key = resolve_match(match).key
    for a, b in zip(timelines, timelines[1:], strict=False):
        nxt_prompt = b.blocks[:-1]
        assert len(nxt_prompt) >= len(a)
        assert [key(x) for x in a] == [key(y) for y in nxt_prompt[: len(a)]]
    res = merge(timelines, match)
    assert res.survivors == [len(timelines) - 1]
    s = res.timelines[0]
    assert [b.author for b in s].count("llm") == 3
    assert s.num_trainable_tokens() == sum(x.blocks[-1].loss_mask.count(1) for x in timelines)
    # every generated token is trained with its sampling logprob
    assert {lp for b in s if b.author == "llm" for lp in b.logprobs} == {-0.25}


def test_cache_tokenizes_only_new_blocks(tok):
    r = ChatRenderer(tok)
    msgs = conversation()
    r.render_prompt(msgs[:4])
    before = r.stats["encodes"]
    blocks = r.render_prompt(msgs[:6], TOOLS)  # other tools: other conversation, full work
    assert flat(blocks) == ref_ids(tok, msgs[:6], TOOLS)
    r.render_prompt(msgs[:6])
    mid = r.stats["encodes"]
    r.render_prompt(msgs[:8])  # two new messages: assistant (header/body/trailer) + user
    assert r.stats["encodes"] - mid <= 4
    assert r.stats["reused_messages"] >= 6
    assert mid > before


def test_completion_block(tok):
    r = ChatRenderer(tok)
    ids = gen_ids(tok, "yes")
    b = r.completion_block(ids, [-1.0] * len(ids))
    assert b.author == "llm" and b.text == "yes<|im_end|>" and b.loss_mask == [1] * len(ids)
    with pytest.raises(ValueError):
        r.completion_block(ids, [0.0])
    with pytest.raises(ValueError):
        r.render_prompt([])


# --------------------------------------------------------------------------- drift
def think_episode(tok, r):
    gen1 = "<think>\nadd 12 and 7\n</think>\n\nThe answer is 19."
    msgs1 = [{"role": "user", "content": "What is 12 + 7?"}]
    p1 = r.render_prompt(msgs1)
    ids1 = gen_ids(tok, gen1)
    t1 = Timeline(p1 + [r.completion_block(ids1, [-0.5] * len(ids1))])
    msgs2 = msgs1 + [{"role": "assistant", "content": gen1}, {"role": "user", "content": "Sure?"}]
    p2 = r.render_prompt(msgs2)
    ids2 = gen_ids(tok, "Yes.")
    t2 = Timeline(p2 + [r.completion_block(ids2, [-0.5] * len(ids2))])
    return t1, t2, p2, msgs2


def test_think_stripping_text_merges_token_does_not(tok):
    r = ChatRenderer(tok, chat_template=THINK_TEMPLATE)
    t1, t2, p2, msgs2 = think_episode(tok, r)
    assert flat(p2) == ref_ids(tok, msgs2, template=THINK_TEMPLATE)
    hist = p2[2]
    gen = t1.blocks[-1]
    assert hist.author == "history"
    assert "<think>" not in tok.decode(hist.token_ids)  # the template stripped it ...
    assert hist.text == gen.text  # ... but the block text is what the model generated
    assert hist.token_ids != gen.token_ids
    text = merge([t1, t2], "text")
    assert text.survivors == [1]
    merged = text.timelines[0]
    assert merged.blocks[2].token_ids == gen.token_ids and merged.blocks[2].author == "llm"
    assert merge([t1, t2], "token").survivors == [0, 1]


def test_think_kept_inside_a_tool_loop_merges_under_token(tok):
    # after the last user query the template keeps the reasoning, so tokens agree too
    r = ChatRenderer(tok, chat_template=THINK_TEMPLATE)
    gen1 = "<think>\nneed the tool\n</think>\n\ncall weather"
    msgs1 = [{"role": "user", "content": "weather?"}]
    ids1 = gen_ids(tok, gen1)
    t1 = Timeline(r.render_prompt(msgs1) + [r.completion_block(ids1, [-0.5] * len(ids1))])
    msgs2 = msgs1 + [{"role": "assistant", "content": gen1}, {"role": "tool", "content": "sunny"}]
    ids2 = gen_ids(tok, "It is sunny.")
    t2 = Timeline(r.render_prompt(msgs2) + [r.completion_block(ids2, [-0.5] * len(ids2))])
    assert flat(t2.blocks[:-1]) == ref_ids(tok, msgs2, template=THINK_TEMPLATE)
    assert merge([t1, t2], "token").survivors == [1]
    assert merge([t1, t2], "text").survivors == [1]


_LOOP = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"


@pytest.mark.parametrize("template, provable", [
    (None, True), (SMOL_TEMPLATE, True), (THINK_TEMPLATE, True),
    (_LOOP + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}.", False),  # text after it
    (_LOOP + "{% if add_generation_prompt %}{{ '<|im_start|>' + messages[-1]['role'] }}\n{% endif %}", False),
    (_LOOP.replace("{% for", "{% if not add_generation_prompt %}x{% endif %}{% for")
     + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", False),  # read elsewhere too
    ("{% set head = '<|im_start|>' %}" + _LOOP + "{% if add_generation_prompt %}{{ head }}assistant\n{% endif %}",
     False),  # a variable the template sets
], ids=["tiny", "smol", "think", "trailing-text", "reads-messages", "read-twice", "assigned-variable"])
def test_the_generation_prompt_is_cut_off_only_where_provably_fixed(tok, template, provable):
    """Where the template provably writes the generation prompt last from its options alone, the
    render without it is cut from the render with it (2 renders per new turn instead of 3); every
    other template is rendered both ways. The ids equal apply_chat_template either way."""
    r = ChatRenderer(tok, chat_template=template)
    msgs = [m for m in conversation(True) if not m.get("tool_calls") and m["role"] != "tool"]
    for n in range(1, len(msgs) + 1):
        before = r.stats["renders"]
        assert flat(r.render_prompt(msgs[:n])) == ref_ids(tok, msgs[:n], None, template), n
        if n > 2:  # one new message (after the first calls): the full render, plus the render without it
            assert r.stats["renders"] - before == (1 if provable else 2), n
    assert (r._gen_prompt[False] is not None) == provable
