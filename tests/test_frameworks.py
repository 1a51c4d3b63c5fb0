"""The calc_agent agent of examples/frameworks/ in each framework, against a real server over HTTP.

A server on 127.0.0.1 (uvicorn in a thread) answers from a script: the first
call of an episode gets a calculator tool call for the task's expression, a
call whose prompt holds a tool result gets ``<answer>RESULT</answer>``. For
each framework: the episode ends with the right answer (reward 1.1); its two
timelines merge into ONE training sample; the requests carry the task's
system prompt and tool; and the timelines are token-identical to the raw-httpx
reference, except where a framework sends different content (documented in
examples/frameworks/README.md and pinned here). A framework whose package is
not installed is skipped (``pip install -e '.[agents]'``). The slow tests
train a few steps on the tiny model with the hf backend, one run per framework.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from swarmkit.client import SwarmClient
from swarmkit.tasks import Task, make_tasks
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, SYSTEM_PROMPT, grade, run_calc_episode
from swarmkit.timelines import Timeline
from swarmkit.timelines.merging import merge_timelines

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "frameworks"
TOKEN = "frameworks-admin-token-" + "x" * 16

#: example module -> the packages it imports
FRAMEWORKS: dict[str, list[str]] = {
    "raw_httpx": ["httpx"],
    "openai_sdk": ["openai"],
    "langgraph_agent": ["langchain_openai", "langgraph"],
    "agentscope_agent": ["agentscope"],
    "openai_agents": ["agents"],
    "pydantic_ai_agent": ["pydantic_ai"],
    "anthropic_sdk": ["anthropic"],
    "openai_responses": ["openai"],
    "openai_agents_responses": ["agents"],
    "pydantic_ai_responses": ["pydantic_ai"],
    "crewai_agent": ["crewai"],
}
NAMES = list(FRAMEWORKS)
#: frameworks outside the `agents` extra: CrewAI pins openai<3 and pydantic<2.13, below the other frameworks'
INSTALL = {"crewai_agent": "pip install -e '.[crewai]' in a venv of its own (examples/frameworks/README.md)"}
#: the agents that speak Chat Completions (the others: Anthropic Messages, OpenAI Responses)
CHAT_NAMES = [n for n in NAMES if n not in ("anthropic_sdk", "openai_responses", "openai_agents_responses",
                                            "pydantic_ai_responses", "crewai_agent")]
#: agents that write a system prompt of their own (CrewAI: from role, goal and backstory): their prompts are
#: not the reference's, their generated tokens are
OWN_PROMPT = ["crewai_agent"]

#: what each framework puts on the wire beyond the reference (asserted, and listed in the README)
WIRE: dict[str, dict[str, Any]] = {
    "raw_httpx": {},
    "openai_sdk": {},
    "langgraph_agent": {"max_tokens_field": "max_completion_tokens", "stream": False},
    "agentscope_agent": {"content_parts": True, "names": True, "max_tokens_field": "max_completion_tokens",
                         "stream": True},
    "openai_agents": {"strict": False},
    "pydantic_ai_agent": {"max_tokens_field": "max_completion_tokens", "stream": False, "tool_choice": "auto",
                          "compact_arguments": True},
}
#: frameworks whose prompts differ from the reference's, and how: (reference text, their text)
_STRICT_TOOL = copy.deepcopy(CALCULATOR_TOOL)
_STRICT_TOOL["function"]["strict"] = False
#: (none since the server drops the no-op `"strict": false` the Agents SDK sends with every tool)
DIFFERS: dict[str, tuple[str, str]] = {}
#: the tiny model's own template (tool results in a `tool` turn) and the one the main job's
#: SmolLM2 runs with (tools in the system turn one per line, results as <tool_response> in a user turn)
TEMPLATES = ["builtin:tiny", "builtin:smollm2_tools"]

TASKS = make_tasks("calc_agent", 2, split="eval")
TASK = TASKS[0]
#: the problems the script knows (the command line runs the first train and eval tasks of seed 0)
KNOWN = [*make_tasks("calc_agent", 4, split="eval"), *make_tasks("calc_agent", 8, split="train")]
#: a task the script never lets finish: every call gets a tool call back
LOOP = Task("loop", [TASKS[1].messages[0], {"role": "user", "content": "LOOP " + TASKS[1].messages[1]["content"]}],
            TASKS[1].answer, "calc_agent", dict(TASKS[1].meta))
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
#: a task whose model calls the calculator with the wrong argument name
BAD_ARGS = Task("bad-args", [TASKS[1].messages[0], {"role": "user", "content": "BADARGS " + TASKS[1].messages[1]["content"]}],
                TASKS[1].answer, "calc_agent", dict(TASKS[1].meta))


def script(prompt: str) -> str:
    """The model: call the calculator on the task's expression, then answer with the tool's result."""
    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>|<tool_response>\n(.*?)\n</tool_response>", prompt, re.S)
    results = [a or b for a, b in results]
    if results and "LOOP" not in prompt:
        return f"<answer>{results[-1]}</answer>"
    if "BADARGS" in prompt:
        return '<tool_call>\n{"name": "calculator", "arguments": {"value": "1"}}\n</tool_call>'
    for task in (*KNOWN, LOOP):
        if task.messages[1]["content"] in prompt:
            return CALL % task.meta["expression"]
    return "I do not know this problem."


def load(name: str) -> ModuleType:
    """An example module (skipped when its framework is not installed)."""
    for package in FRAMEWORKS[name]:
        pytest.importorskip(package, reason=f"examples/frameworks/{name}.py needs {package}: "
                                            + INSTALL.get(name, "pip install -e '.[agents]'"))
    return _load_file(name)


def _load_file(name: str) -> ModuleType:
    key = f"swarmkit_examples_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


# --------------------------------------------------------------------------- the server
class Recorder:
    """ASGI wrapper keeping every chat request body with its bearer key (what frameworks send)."""

    def __init__(self, app: Any):
        self.app = app
        self.bodies: list[tuple[str, dict]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].endswith(("/chat/completions", "/messages", "/responses")):
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        headers = dict(scope["headers"])
        auth = headers.get(b"authorization", b"").decode().removeprefix("Bearer ") or headers.get(b"x-api-key", b"").decode()
        self.bodies.append((auth, json.loads(body)))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def of(self, key: str) -> list[dict]:
        return [b for k, b in self.bodies if k == key]


@dataclass
class Server:
    client: SwarmClient
    recorder: Recorder
    tokenizer: Any
    template: str


@contextlib.contextmanager
def recorded_server(model: Callable[[str], str], template: str, run_dir: Path,
                    overrides: Sequence[str] = ()) -> Iterator[Server]:
    """A server on 127.0.0.1 (uvicorn in a thread, the tiny tokenizer, chat template ``template``) whose
    scripted model answers ``model(prompt)``, every chat request recorded, ROLLING (this file's fixture and
    test_frameworks_more's); ``overrides`` are more config overrides."""
    from swarmkit.apps.wiring import build_server
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.plugins import get_registry
    from swarmkit.server.run import run_in_thread
    from swarmkit.testing.scripted import ScriptedBackend

    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, replies=lambda ids: model(tok.decode(ids)))
    config = validate_config(compose(["model=tiny", f"model.chat_template={template}", *overrides]),
                             get_registry())
    srv, app = build_server({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(run_dir)}},
                            train=False, config=config, backend_factory=lambda cfg: backend)
    recorder = Recorder(app)
    handle = run_in_thread(srv, recorder)
    client = SwarmClient(handle.url, token=TOKEN, retry_for=10)
    try:
        client.start()
        client.wait_for_state("ROLLING", timeout=30)
        yield Server(client, recorder, tok, template)
    finally:
        client.close()
        handle.stop()


@pytest.fixture(scope="module", params=TEMPLATES)
def server(request, tmp_path_factory):
    with recorded_server(script, request.param, tmp_path_factory.mktemp("frameworks")) as served:
        yield served


@dataclass
class Run:
    result: tuple[str, int, int, int]
    reward: float
    report: dict
    timelines: list[Timeline]
    bodies: list[dict]


def _reference(base_url, api_key, task, *, temperature, seed):
    """swarmkit's own agent loop (the main job's), as a run_episode."""
    with httpx.Client(timeout=60) as http:
        out = run_calc_episode(http, base_url, api_key, task, max_tokens=64, temperature=temperature, seed=seed)
    return out.completion, int(out.metrics["valid_tool_call"]), int(out.metrics["tool_calls"]), int(out.metrics["turns"])


def episode_runs(server: Server, episode_of: Callable[[str], Callable[..., Any]]) -> Callable[..., Run]:
    """``get(name, task=TASK)``: the Run of one episode of ``episode_of(name)`` (a run_episode), run once per
    (name, task) and shared by the tests (this file's ``runs`` and test_frameworks_more's)."""
    done: dict[tuple[str, str], Run] = {}

    def get(name: str, task: Task = TASK) -> Run:
        if (name, task.task_id) not in done:
            run_episode = episode_of(name)
            with server.client.episode(task_id=task.task_id) as ep:
                result = run_episode(ep.base_url, ep.api_key, task, temperature=1.0, seed=7)
                outcome = grade(task, *result)
                report = ep.report(outcome.reward)
                timelines = ep.timelines(as_objects=True)
            done[name, task.task_id] = Run(result, outcome.reward, report, timelines,
                                           server.recorder.of(ep.api_key))
        return done[name, task.task_id]

    return get


@pytest.fixture(scope="module")
def runs(server):
    """One episode per (framework, task), shared by the tests."""
    return episode_runs(server, lambda name: _reference if name == "reference" else load(name).run_episode)


def _text(content: Any) -> str:
    return "".join(p["text"] for p in content) if isinstance(content, list) else content


# --------------------------------------------------------------------------- (a) the episode
@pytest.mark.parametrize("name", NAMES)
def test_the_episode_ends_with_the_right_answer(runs, name):
    run = runs(name)
    assert run.result == (f"<answer>{TASK.answer}</answer>", 1, 1, 2)
    assert run.reward == pytest.approx(1.1)
    assert run.report["accepted"] is True and run.report["reward"] == pytest.approx(1.1)


# --------------------------------------------------------------------------- (b) one sample
@pytest.mark.parametrize("name", NAMES)
def test_the_tool_turns_merge_into_one_sample(runs, name):
    tls = runs(name).timelines
    assert len(tls) == 2
    (sample,) = merge_timelines(tls, "token")
    assert sum(sum(b.loss_mask) for b in sample.blocks) == sum(len(tl.blocks[-1].token_ids) for tl in tls)
    assert sample.token_ids() == tls[-1].token_ids()


# --------------------------------------------------------------------------- (c) what is sent
@pytest.mark.parametrize("name", CHAT_NAMES)
def test_the_requests_carry_the_task_prompt_tool_and_result(runs, name):
    first, second = runs(name).bodies
    wire = WIRE[name]
    tool = _STRICT_TOOL if wire.get("strict") is False else CALCULATOR_TOOL
    for body in (first, second):
        system, user = body["messages"][:2]
        assert (system["role"], _text(system["content"])) == ("system", SYSTEM_PROMPT)
        assert (user["role"], _text(user["content"])) == ("user", TASK.messages[1]["content"])
        assert isinstance(user["content"], list) == wire.get("content_parts", False)
        assert ("name" in user) == wire.get("names", False)
        assert body["tools"] == [tool], "the tool schema differs from CALCULATOR_TOOL"
        assert body.get(wire.get("max_tokens_field", "max_tokens")) == 64
        assert body.get("stream", False) == wire.get("stream", False)
        assert body.get("tool_choice") == wire.get("tool_choice")
        assert body["temperature"] == 1.0 and body.get("seed") == 7
    assert len(first["messages"]) == 2
    call, result = second["messages"][2:]
    # every framework sends the tool-call turn back with content null
    assert call["role"] == "assistant" and call["content"] is None and len(call["tool_calls"]) == 1
    arguments = call["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"expression": TASK.meta["expression"]}
    assert (arguments == json.dumps({"expression": TASK.meta["expression"]}, separators=(",", ":"))) == \
        wire.get("compact_arguments", False)
    assert result["role"] == "tool" and result["content"] == TASK.answer
    assert result["tool_call_id"] == call["tool_calls"][0]["id"]


def test_the_anthropic_sdk_sends_messages_blocks(runs):
    first, second = runs("anthropic_sdk").bodies
    question = TASK.messages[1]["content"]
    for body in (first, second):
        assert body["system"] == SYSTEM_PROMPT and body["max_tokens"] == 64
        assert body["tools"] == [load("anthropic_sdk").TOOL]
        assert body["messages"][0] == {"role": "user", "content": question}
    use, result = second["messages"][1:]
    (block,) = use["content"]
    assert block["type"] == "tool_use" and block["input"] == {"expression": TASK.meta["expression"]}
    assert result == {"role": "user", "content": [{"type": "tool_result", "tool_use_id": block["id"],
                                                   "content": TASK.answer}]}


@pytest.mark.parametrize("name", ["openai_responses", "openai_agents_responses", "pydantic_ai_responses"])
def test_the_responses_agents_send_items(runs, name):
    first, second = runs(name).bodies
    question = TASK.messages[1]["content"]
    for body in (first, second):
        assert body["instructions"] == SYSTEM_PROMPT and body["max_output_tokens"] == 64
        (tool,) = body["tools"]
        assert tool["type"] == "function" and tool["name"] == "calculator" and tool.get("strict", False) is False
    assert first["input"] == [{"role": "user", "content": question}]
    if name == "openai_responses":  # continues the stored response
        assert second["previous_response_id"].startswith("resp_")
        (output,) = second["input"]
    else:  # the Agents SDK and Pydantic AI send the whole history back, the function_call item included
        # (Pydantic AI re-serialises its arguments compactly: the server replays the turn as generated)
        assert "previous_response_id" not in second
        user, call, output = second["input"]
        assert user == first["input"][0] and call["type"] == "function_call"
        assert json.loads(call["arguments"]) == {"expression": TASK.meta["expression"]}
    assert output["type"] == "function_call_output" and output["output"] == TASK.answer


@pytest.mark.parametrize("name", NAMES)
def test_the_timelines_are_token_identical_to_raw_httpx(runs, server, name):
    reference = runs("raw_httpx").timelines
    mine = runs(name).timelines
    assert [tl.blocks[-1].token_ids for tl in mine] == [tl.blocks[-1].token_ids for tl in reference]
    if name in OWN_PROMPT:
        assert [tl.token_ids() for tl in mine] != [tl.token_ids() for tl in reference]
        return
    if name not in DIFFERS:
        assert [tl.token_ids() for tl in mine] == [tl.token_ids() for tl in reference]
        return
    # a framework that sends other content: the prompts differ exactly there
    theirs, ours = DIFFERS[name]
    decode = server.tokenizer.decode
    assert [tl.token_ids() for tl in mine] != [tl.token_ids() for tl in reference]
    assert [decode(tl.token_ids()) for tl in mine] == [decode(tl.token_ids()).replace(theirs, ours)
                                                       for tl in reference]


def test_raw_httpx_sends_what_swarmkits_own_agent_loop_sends(runs):
    assert [tl.token_ids() for tl in runs("reference").timelines] == \
        [tl.token_ids() for tl in runs("raw_httpx").timelines]
    def without_ids(obj):
        if isinstance(obj, dict):
            return {k: without_ids(v) for k, v in obj.items() if k not in ("id", "tool_call_id")}
        return [without_ids(v) for v in obj] if isinstance(obj, list) else obj

    assert without_ids(runs("reference").bodies) == without_ids(runs("raw_httpx").bodies)


@pytest.mark.parametrize("name", NAMES)
def test_the_agent_stops_after_three_turns(runs, name):
    run = runs(name, LOOP)
    final, valid, calls, turns = run.result
    assert turns == 3 and len(run.timelines) == 3
    if name == "agentscope_agent":
        # AgentScope's last turn at the limit is forced: a reminder message and tool_choice "none",
        # so the tool call comes back as text
        assert (valid, calls) == (2, 2) and final == CALL % LOOP.meta["expression"]
        assert run.bodies[-1]["tool_choice"] == "none"
        assert "maximum of 2 reasoning-acting iterations" in _text(run.bodies[-1]["messages"][-1]["content"])
    elif name == "crewai_agent":
        # CrewAI's too: after max_iter it asks for a final answer and offers no tools, so the call is text
        assert (valid, calls) == (2, 2) and final == CALL % LOOP.meta["expression"]
        assert "tools" not in run.bodies[-1]
        assert "MUST give your absolute best final answer" in _text(run.bodies[-1]["messages"][-1]["content"])
    else:
        assert (final, valid, calls) == ("", 3, 3)
    assert run.reward == pytest.approx(0.1)
    # CrewAI's forced last call sends no tools, so its prompt (the template renders the tools first) is not
    # an extension of the others: a sample of its own
    assert len(merge_timelines(run.timelines, "token")) == (2 if name == "crewai_agent" else 1)


@pytest.mark.parametrize("name", NAMES)
def test_the_command_line_trains_and_evaluates_with_episodes_at_once(server, capsys, name):
    check_command_line(server, capsys, name, load(name))


def check_command_line(server: Server, capsys: pytest.CaptureFixture[str], name: str, module: ModuleType) -> None:
    """examples/frameworks/swarm_loop.py's command line with ``module``'s run_episode: 4 training episodes
    in groups of 2, 4 at once, then 4 eval tasks, every one right (this file's test and test_frameworks_more's)."""
    loop = _load_file("swarm_loop")
    loop.main(module.run_episode, name, ["--url", server.client.url, "--token", TOKEN, "--episodes", "4",
                                         "--group", "2", "--eval", "4", "--concurrency", "4"])
    out = capsys.readouterr().out
    assert f"{name}: 4 episodes, mean reward 1.100" in out
    assert f"{name} eval (4 tasks): accuracy 1.000  valid tool calls 1.000  reward 1.100" in out


# --------------------------------------------------------------------------- (d) real training
@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_a_short_training_run_on_the_tiny_model(name, tmp_path):
    """Episodes of the framework on the tiny random model (hf backend): two GRPO steps, finite losses."""
    short_training_run(load(name), tmp_path)


def short_training_run(module: ModuleType, run_dir: Path, overrides: Sequence[str] = (),
                       step_timeout_s: float = 120) -> list[Any]:
    """Four episodes of ``module``'s run_episode (groups of 2, 2 at once) on a server of the tiny model (hf
    backend, CPU; ``overrides`` after ``model=tiny``) until its two GRPO steps, whose losses must be
    finite; returns the episodes' outcomes (this file's slow test and test_frameworks_more's)."""
    from swarmkit.apps.serve import start_server_thread
    from swarmkit.swarm.metrics import read_metrics

    loop = _load_file("swarm_loop")
    handle = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                             "run_dir": str(run_dir)}})
    try:
        with SwarmClient(handle.url, token=TOKEN, retry_for=120) as client:
            client.configure(["model=tiny", *overrides, "backend=hf", "backend.device=cpu",
                              "backend.batch_wait_s=0.01", "batching=c1", "batching.batch_size=1",
                              "batching.rollouts_per_task=2", "trainer.total_steps=2", "optim.lr=1e-3"])
            client.start()
            client.wait_for_state("ROLLING", timeout=120)
            outcomes: list[Any] = loop.train(client, module.run_episode, 4, group=2, concurrency=2)
            deadline = time.monotonic() + step_timeout_s
            while client.status()["global_step"] < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert client.status()["global_step"] == 2
    finally:
        handle.stop()
    assert len(outcomes) == 4
    rows = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["samples"] >= 1 and r["trained_tokens"] > 0 for r in rows)
    return outcomes


@pytest.mark.parametrize("name", NAMES)
def test_a_malformed_tool_call_is_answered_with_an_error_not_a_crash(runs, name):
    """The model's wrong argument names come back to it as an error result (the calculator's, or
    AgentScope's own input validation), as in swarmkit's own loop: the episode is not lost."""
    final, valid, calls, turns = runs(name, BAD_ARGS).result
    assert (valid, calls) == (0, 1) and turns == 2
    assert final.startswith("<answer>") and ("error" in final or "validation failed" in final), final


