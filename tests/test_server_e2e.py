"""End to end: a real ``python -m swarmkit mode=server`` process, the tiny model, the openai SDK.

The server is configured and started through :class:`SwarmClient`; agents
talk to it through the official ``openai`` package over real sockets; the
recorded timelines are checked against the tokenizer's chat template and a
separate transformers forward pass. About 10 s on 2 cores, so it runs in the
default (``-m "not slow"``) suite: it is the acceptance test of the server.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from swarmkit.client import SwarmAPIError, SwarmClient  # noqa: E402

TOKEN = "e2e-admin-token-" + "x" * 16
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("server-run")
    port = free_port()
    env = dict(os.environ, SWARMKIT_ADMIN_TOKEN=TOKEN, SWARMKIT_TORCH_THREADS="1", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    log = open(run_dir / "server.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}", f"server.run_dir={run_dir}"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    client = SwarmClient(url, token=TOKEN, retry_for=30)
    try:
        assert client.wait_for_state("OFFLINE", timeout=30)["state"] == "OFFLINE"
        client.configure(["model.path=builtin:tiny", "backend=hf", "backend.device=cpu", "backend.batch_wait_s=0.01"])
        client.start()
        client.wait_for_state("ROLLING", timeout=60)
        yield client, proc, run_dir
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.seek(0)
        print(log.read()[-4000:])
        log.close()


@pytest.fixture(scope="module")
def reference():
    """The tiny model and its tokenizer, loaded separately from the server."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarmkit.models import tiny_model_dir

    torch.set_num_threads(1)
    folder = tiny_model_dir()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def template_ids(tok, messages, tools=None) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    if not isinstance(out, list):
        out = out["input_ids"]
    return list(out)


def check_timeline(tl: dict, messages: list[dict], tools, reference, generated=()) -> None:
    """The prompt is the chat template's render of ``messages``: the same tokens, except an
    earlier turn the server generated (``generated``: its completion ids), which is replayed
    with the model's own tokens (the same text, possibly another tokenization)."""
    model, tok = reference
    blocks = tl["blocks"]
    *prompt, completion = blocks
    prompt_ids = [t for b in prompt for t in b["token_ids"]]
    if prompt_ids != template_ids(tok, messages, tools):
        # a replayed turn is the model's own tokens for the same text (possibly another tokenization)
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        assert tok.decode(prompt_ids) == text, "prompt text differs from the chat template"
        for b in prompt:
            if b["token_ids"] != tok.encode(b["text"], add_special_tokens=False):
                assert b["author"] == "history" and any(b["token_ids"][: len(g)] == g for g in generated), \
                    "prompt tokens differ from the chat template outside a replayed generated turn"
    assert completion["author"] == "llm"
    assert completion["loss_mask"] == [1] * len(completion["token_ids"]) and completion["token_ids"]
    for b in prompt:
        assert set(b["loss_mask"]) <= {0}, f"prompt block {b['author']} has trained tokens"
    ids = prompt_ids + completion["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    n = len(prompt_ids)
    ref = [lp[n - 1 + k, t].item() for k, t in enumerate(completion["token_ids"])]
    got = completion["logprobs"]
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) < 1e-4, (ref, got)


def dump(messages):
    """Messages as the server received them (the SDK sends plain JSON)."""
    return json.loads(json.dumps(messages))


def test_multi_turn_agent_with_tools_is_recorded_token_by_token(server, reference):
    client, _, _ = server
    sent: list[tuple[list[dict], list | None, int]] = []  # (messages of a call, tools, number of choices)
    with client.episode(task_id="weather-1") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"},
        ]
        # turn 1: non-streaming, logprobs with alternatives
        r1 = llm.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=12,
                                         temperature=1.0, top_p=0.95, logprobs=True, top_logprobs=2, seed=1)
        sent.append((dump(messages), TOOLS, 1))
        msg = r1.choices[0].message
        assert r1.usage.prompt_tokens == len(template_ids(reference[1], messages, TOOLS))
        assert len(r1.choices[0].logprobs.content) == r1.usage.completion_tokens
        assert all(len(t.top_logprobs) == 2 for t in r1.choices[0].logprobs.content)
        calls = [tc.model_dump() for tc in msg.tool_calls or []] or [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]
        messages += [
            {"role": "assistant", "content": msg.content, "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21 degrees"},
        ]
        # turn 2: streaming
        stream = llm.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=10,
                                             stream=True, stream_options={"include_usage": True})
        pieces, usage, finish = [], None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append(c.delta.content or "")
                finish = c.finish_reason or finish
        sent.append((dump(messages), TOOLS, 1))
        assert usage is not None and usage.completion_tokens >= 1 and finish in ("stop", "length", "tool_calls")
        messages += [{"role": "assistant", "content": "".join(pieces)},
                     {"role": "user", "content": "Thanks! And tomorrow?"}]
        # turn 3: two choices with a stop string
        r3 = llm.chat.completions.create(model="tiny", messages=messages, max_tokens=8, n=2, stop=["\n\n"])
        sent.append((dump(messages), None, 2))
        assert len(r3.choices) == 2
        models = llm.models.list()
        assert len(models.data) == 1 and models.data[0].id == r1.model
        result = ep.report(1.0)
        assert result["accepted"] is True
        timelines = ep.timelines()
    assert len(timelines) == sum(n for _, _, n in sent)
    expected = [(m, t) for m, t, n in sent for _ in range(n)]
    for k, (tl, (msgs, tools)) in enumerate(zip(timelines, expected, strict=True)):
        check_timeline(tl, msgs, tools, reference, [t["blocks"][-1]["token_ids"] for t in timelines[:k]])
    # the recorded first completion is what the agent received
    first = timelines[0]["blocks"][-1]
    assert [t.logprob for t in r1.choices[0].logprobs.content] == pytest.approx(first["logprobs"], abs=1e-6)
    # the ended episode is closed to further calls and reports
    with pytest.raises(openai.APIStatusError) as info:
        llm.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert info.value.status_code in (409, 410)
    with pytest.raises(SwarmAPIError) as err:
        ep.report(0.0)
    assert err.value.status == 409
    status = client.status()
    assert status["state"] == "ROLLING" and status["pool"]["episodes"] >= 1 and status["global_step"] == 0


def test_messages_and_responses_record_the_engines_tokens(server, reference):
    """The Anthropic SDK and the openai SDK's Responses API, two turns each (plain, then streamed):
    every prompt is the chat template's render, every completion the engine's tokens with the
    logprobs of a separate forward pass."""
    anthropic = pytest.importorskip("anthropic")
    client, _, _ = server
    system = "You are a helpful assistant."
    with client.episode(task_id="protocols-1") as ep:
        llm = anthropic.Anthropic(base_url=ep.anthropic_base_url, api_key=ep.api_key, max_retries=0)
        history = [{"role": "user", "content": "Name a colour."}]
        r1 = llm.messages.create(model="tiny", system=system, messages=history, max_tokens=8)
        text1 = "".join(b.text for b in r1.content if b.type == "text")
        history += [{"role": "assistant", "content": text1}, {"role": "user", "content": "Another one?"}]
        with llm.messages.stream(model="tiny", system=system, messages=history, max_tokens=8) as stream:
            text2 = "".join(stream.text_stream)
            r2 = stream.get_final_message()
        assert r2.usage.output_tokens >= 1 and isinstance(text2, str)
        ep.report(0.0)
        anthropic_tls = ep.timelines()
    with client.episode(task_id="protocols-2") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        first = llm.responses.create(model="tiny", instructions=system, input="Name a colour.", max_output_tokens=8)
        events = list(llm.responses.create(model="tiny", instructions=system, input="Another one?",
                                           previous_response_id=first.id, max_output_tokens=8, stream=True))
        assert events[-1].type in ("response.completed", "response.incomplete")
        ep.report(0.0)
        responses_tls = ep.timelines()
    turns = [
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."}],
        [{"role": "system", "content": system}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": None}, {"role": "user", "content": "Another one?"}],
    ]
    for tls, first_text in ((anthropic_tls, text1), (responses_tls, first.output_text)):
        assert [tl["meta"]["endpoint"] for tl in tls] in (["messages"] * 2, ["responses"] * 2)
        turns[1][2]["content"] = first_text
        for k, (tl, msgs) in enumerate(zip(tls, turns, strict=True)):
            check_timeline(tl, msgs, None, reference, [t["blocks"][-1]["token_ids"] for t in tls[:k]])


def test_sampling_fields_shape_the_sample_not_the_logprobs(server, reference):
    """logit_bias, top_k and the penalties reach the engine; the recorded logprobs stay those of
    the raw distribution (what training compares against)."""
    client, _, _ = server
    _, tok = reference
    target = tok.encode("hello", add_special_tokens=False)[0]
    messages = [{"role": "user", "content": "Say something."}]
    with client.episode(task_id="sampling-1") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        r = llm.chat.completions.create(model="tiny", messages=messages, max_tokens=4, logit_bias={str(target): 100},
                                        logprobs=True)
        assert r.usage.completion_tokens == 4
        r2 = llm.chat.completions.create(model="tiny", messages=messages, max_tokens=4, frequency_penalty=1.5,
                                         presence_penalty=0.5, extra_body={"top_k": 5, "min_p": 0.01,
                                                                           "repetition_penalty": 1.3})
        assert r2.choices[0].finish_reason in ("stop", "length")
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            llm.chat.completions.create(model="tiny", messages=messages, max_tokens=2, logit_bias={"99999999": 1})
        ep.report(0.0)
        tls = ep.timelines()
    first = tls[0]["blocks"][-1]
    assert first["token_ids"] == [target] * 4
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(first["logprobs"], abs=1e-6)
    for tl in tls:
        check_timeline(tl, messages, None, reference)


def test_special_tokens_the_model_generates_come_back_and_extend_the_timeline(server, reference):
    """The returned content keeps a special token the model generated, so the history the agent
    sends back replays the recorded completion: the next turn extends the timeline and the two
    merge into one sample. ``skip_special_tokens`` (a vLLM field) asks for clean text instead."""
    from swarmkit.timelines import Timeline, merge_timelines

    client, _, _ = server
    _, tok = reference
    special = tok.convert_tokens_to_ids("<|im_start|>")
    messages = [{"role": "user", "content": "Say something."}]
    with client.episode(task_id="special-1") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        r = llm.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                        logit_bias={str(special): 100})
        assert r.choices[0].message.content == "<|im_start|>" * 3
        clean = llm.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                            logit_bias={str(special): 100}, extra_body={"skip_special_tokens": True})
        assert clean.choices[0].message.content in ("", None)
        with pytest.raises(openai.BadRequestError, match="skip_special_tokens"):
            llm.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                        extra_body={"skip_special_tokens": "yes"})
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "Again?"}]
        llm.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        ep.report(0.0)
        first, _, second = ep.timelines()
    ids = [[t for b in tl["blocks"] for t in b["token_ids"]] for tl in (first, second)]
    assert first["blocks"][-1]["token_ids"] == [special] * 3
    assert ids[1][: len(ids[0])] == ids[0], "the second turn does not extend the first"
    assert len(merge_timelines([Timeline.from_dict(first), Timeline.from_dict(second)])) == 1


def test_concurrent_episodes_keep_separate_timelines(server, reference):
    client, _, _ = server
    _, tok = reference
    n_eps = 32

    def run(i: int):
        with client.episode(task_id=f"task-{i}") as ep:
            llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
            msgs = [{"role": "user", "content": f"episode marker {i} apple"}]
            r = llm.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=1.0)
            first = list(msgs)
            msgs = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                           {"role": "user", "content": f"second turn of {i}"}]
            if i % 2:
                for _ in llm.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, stream=True):
                    pass
            else:
                llm.chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
            ep.report(float(i % 3))
            return i, [first, msgs], ep.timelines()

    with ThreadPoolExecutor(n_eps) as pool:
        results = list(pool.map(run, range(n_eps)))
    for i, sent, tls in results:
        assert len(tls) == 2, f"episode {i} has {len(tls)} timelines"
        for k, (tl, msgs) in enumerate(zip(tls, sent, strict=True)):
            check_timeline(tl, dump(msgs), None, reference, [t["blocks"][-1]["token_ids"] for t in tls[:k]])
            text = "".join(b["text"] for b in tl["blocks"][:-1])
            assert f"marker {i} apple" in text
            others = [j for j in range(n_eps) if j != i and f"marker {j} apple" in text]
            assert not others, f"episode {i} saw the prompts of {others}"
            assert tl["meta"]["task_id"] == f"task-{i}"


def test_bad_input_over_real_sockets_leaves_server_up(server):
    client, proc, _ = server
    import httpx

    url = client.url
    with httpx.Client(base_url=url, timeout=10) as http:
        assert http.post("/v1/chat/completions", content=b"{nope", headers={"Authorization": "Bearer x"}).status_code \
            in (400, 401)
        assert http.post("/api/v1/episodes", content=b"{nope").status_code == 400
        assert http.post("/api/v1/episodes", json={}).status_code == 422
        big = b"x" * (8_000_001)
        assert http.post("/api/v1/episodes", content=big).status_code == 413
        assert http.post("/api/v1/admin/start").status_code == 401
        assert http.post("/api/v1/admin/start", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert proc.poll() is None
    assert client.health()["state"] == "ROLLING"


def test_server_prints_url_and_writes_private_admin_token(tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "SWARMKIT_ADMIN_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}", f"server.run_dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )
    try:
        lines = []
        end = time.time() + 30
        while time.time() < end:
            line = proc.stdout.readline()
            lines.append(line)
            if "admin token" in line:
                break
        out = "".join(lines)
        assert f"http://127.0.0.1:{port}" in out and f"http://127.0.0.1:{port}/dashboard" in out
        token_file = tmp_path / "admin_token"
        assert str(token_file) in out
        assert (token_file.stat().st_mode & 0o777) == 0o600
        token = token_file.read_text().strip()
        with SwarmClient(f"http://127.0.0.1:{port}", token=token) as c:
            assert c.status()["state"] == "OFFLINE"
        with SwarmClient(f"http://127.0.0.1:{port}", token="wrong", retry_for=2) as c, pytest.raises(SwarmAPIError) as e:
            c.status()
        assert e.value.status == 403
    finally:
        proc.terminate()
        proc.wait(10)


def test_run_files_are_private_and_tokens_never_written(tmp_path):
    """A server started with tokens on the command line: the run folder is 0700, what the process
    writes is 0600, and neither token appears in Hydra's record of the run, the configure answer or
    a checkpoint's config.json."""
    port = free_port()
    admin, client_token = "admin-" + "s" * 30, "client-" + "c" * 30
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("SWARMKIT_ADMIN_TOKEN", "SWARMKIT_CLIENT_TOKEN")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}", f"hydra.run.dir={run_dir}",
         f"server.admin_token={admin}", f"server.client_token={client_token}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
    )
    try:
        with SwarmClient(f"http://127.0.0.1:{port}", token=admin, retry_for=60) as c:
            assert c.wait_for_state("OFFLINE", timeout=60)["state"] == "OFFLINE"
            answer = c.configure({"model": {"path": "builtin:tiny"}, "server": {"admin_token": admin}})
            assert answer["config"]["server"]["admin_token"] == "***"
        assert (run_dir.stat().st_mode & 0o777) == 0o700
        hydra_files = list((run_dir / ".hydra").glob("*.yaml"))
        assert hydra_files
        for f in hydra_files:
            text = f.read_text()
            assert admin not in text and client_token not in text, f
            assert (f.stat().st_mode & 0o777) == 0o600
    finally:
        proc.terminate()
        proc.wait(10)
