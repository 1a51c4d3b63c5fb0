"""The ``scripted`` backend: a script file checked up front, answered by a real server process.

- the script format: replies by turn, rules on the new messages, tool calls in the model's format,
  and one named error per bad entry;
- ``python -m swarmkit mode=server backend=scripted backend.script=...``: a real server process
  answers the openai SDK with the script, tool calls included, accepts rewards and runs a no-op
  training step (the policy version moves, no weights);
- a bad script stops the command line with one error line naming the entry, no traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from swarmkit.procs import free_port
from swarmkit_plugins.backend_scripted.script import (
    ScriptError,
    load_script,
    parse_script,
    since_model_spoke,
)

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "scripted-admin-token-" + "x" * 16
SCRIPT = """
rules:
  - when: {contains: "weather"}
    reply: {tool_calls: [{name: get_weather, arguments: {city: Paris}}]}
  - when: {regex: "sunny, \\\\d+"}
    reply: "It is sunny in Paris."
replies:
  - "Hello from the script."
  - "Second turn."
"""


def test_replies_go_by_turn_and_rules_match_the_new_messages_only():
    s = parse_script({"rules": [{"when": {"contains": "ping"}, "reply": "pong"}], "replies": ["a", "b"]})
    assert s.answer("hello", 0) == "a" and s.answer("hello", 1) == "b" and s.answer("hello", 7) == "b"
    assert s.answer("say ping", 3) == "pong"
    chatml = ("<|im_start|>user\nping<|im_end|>\n<|im_start|>assistant\npong<|im_end|>\n"
              "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    new, turn = since_model_spoke(chatml, "<|im_start|>assistant\n", "<|im_end|>", "<|im_start|>user\n")
    assert turn == 1 and "again" in new and "ping" not in new and "pong" not in new


def test_a_tool_call_reply_is_written_in_the_served_tool_call_format():
    s = parse_script([{"content": "Let me look.", "tool_calls": [{"name": "f", "arguments": '{"x": 1}'}]}])
    assert s.answer("", 0) == 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("data, where", [
    ({"replies": [{"tool_calls": [{"arguments": {}}]}]}, "replies[0].tool_calls[0]: 'name' is missing"),
    ({"rules": [{"when": {"regex": "("}, "reply": "x"}]}, "rules[0].when.regex: not a valid regular expression"),
    ({"rules": [{"when": "x", "reply": "y"}]}, "rules[0].when: expected one of"),
    ({"replies": ["a"], "reply": "b"}, "unknown key 'reply'"),
    ({"replies": [{"text": "a"}]}, "replies[0]: unknown key 'text'"),
    ({}, "no replies and no rules"),
])
def test_a_bad_script_names_the_entry(data, where):
    with pytest.raises(ScriptError, match=None) as info:
        parse_script(data)
    assert where in str(info.value)


def test_a_missing_or_unparsable_file_is_named(tmp_path):
    with pytest.raises(ScriptError, match="cannot be read"):
        load_script(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("replies: [a, b\n")
    with pytest.raises(ScriptError, match=r"bad.yaml: not valid YAML/JSON at line"):
        load_script(tmp_path / "bad.yaml")


def server_env(token: str = TOKEN) -> dict[str, str]:
    return dict(os.environ, SWARMKIT_ADMIN_TOKEN=token, SWARMKIT_TORCH_THREADS="1", OMP_NUM_THREADS="1",
                HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


@contextlib.contextmanager
def scripted_server_process(tmp: Path, script: Path, token: str, overrides: Sequence[str] = ()) -> Iterator[Any]:
    """``python -m swarmkit mode=server model=tiny backend=scripted`` playing ``script`` on a free port of
    127.0.0.1 (run dir ``tmp/run``, one no-op training step after two episodes; ``overrides`` after
    ``model=tiny``), ROLLING; yields its ``SwarmClient`` and prints the tail of the server's log at the
    end (this file's fixture and test_coding_agent's)."""
    from swarmkit.client import SwarmClient

    port = free_port()
    log = open(tmp / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "swarmkit", "mode=server", "model=tiny", *overrides,
                             "backend=scripted", f"backend.script={script}", f"server.port={port}",
                             f"server.run_dir={tmp / 'run'}", "batching=c1", "batching.batch_size=2",
                             "batching.rollouts_per_task=1", "trainer.total_steps=1"],
                            stdout=log, stderr=subprocess.STDOUT, env=server_env(token), cwd=tmp)
    client = SwarmClient(f"http://127.0.0.1:{port}", token=token, retry_for=30)
    try:
        client.wait_for_state("ROLLING", timeout=120)
        yield client
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


def test_a_bad_script_stops_the_command_line_with_one_error_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("replies:\n  - tool_calls: [{arguments: {}}]\n")
    proc = subprocess.run([sys.executable, "-m", "swarmkit", "mode=server", "model=tiny", "backend=scripted",
                           f"backend.script={bad}", f"server.run_dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, env=server_env(), timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    problems = [ln for ln in proc.stderr.splitlines() if "backend.script" in ln]
    assert problems == [f"  - backend.script: {bad}: replies[0].tool_calls[0]: 'name' is missing "
                        "(a non-empty string)"], proc.stderr


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("scripted")
    script = tmp / "script.yaml"
    script.write_text(SCRIPT)
    with scripted_server_process(tmp, script, TOKEN) as client:
        yield client, tmp / "run"


def test_a_scripted_server_answers_the_openai_sdk_and_steps_without_weights(scripted_server):
    openai = pytest.importorskip("openai")
    client, run_dir = scripted_server
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    with client.episode(task_id="t1") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key)
        first = llm.chat.completions.create(model="swarm", messages=[{"role": "user", "content": "hi"}])
        assert first.choices[0].message.content == "Hello from the script."
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        call = llm.chat.completions.create(model="swarm", messages=msgs, tools=tools)
        tc = call.choices[0].message.tool_calls
        assert call.choices[0].finish_reason == "tool_calls" and tc[0].function.name == "get_weather"
        assert json.loads(tc[0].function.arguments) == {"city": "Paris"}
        msgs += [call.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tc[0].id, "content": "sunny, 24"}]
        final = llm.chat.completions.create(model="swarm", messages=msgs, tools=tools)
        assert final.choices[0].message.content == "It is sunny in Paris."
        ep.report(1.0)
    with client.episode(task_id="t2") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key)
        streamed = "".join(c.choices[0].delta.content or "" for c in llm.chat.completions.create(
            model="swarm", messages=[{"role": "user", "content": "hi"}], stream=True))
        assert streamed == "Hello from the script."
        ep.report(0.0)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 30
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.1)
    line = json.loads(metrics.read_text().splitlines()[0])
    assert line["noop_step"] == 1.0 and line["step"] == 1, line
    assert client.status()["policy_version"] == 1
