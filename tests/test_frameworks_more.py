"""The calc_agent recipes of examples/frameworks/ for AutoGen, smolagents, LlamaIndex, DSPy, LiteLLM and
Google ADK, against a real server over HTTP (the tests of tests/test_frameworks.py, same server and tasks).

These frameworks pin packages the `agents` extra's frameworks cannot share (openai<3, protobuf 5,
opentelemetry<=1.44), so they live in their own extra, `agents-more`, and CI runs this file in a venv of
its own (.ci/run). A framework whose package is not installed is skipped, unless
SWARMKIT_REQUIRE_FRAMEWORKS=1 (CI's step), where it fails.

A scripted model answers in each framework's own idiom: a native tool call and a plain answer (AutoGen,
LlamaIndex, LiteLLM, Google ADK), smolagents' ``final_answer`` tool call, Python code for smolagents'
``CodeAgent``, DSPy's ``[[ ## field ## ]]`` sections for ``dspy.ReAct``. Every episode's LLM calls must
be captured: one timeline per call, each ending with the scripted reply's tokens, the reward reported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from typing import Any

import pytest
from test_frameworks import (
    BAD_ARGS,
    CALL,
    EXAMPLES,
    KNOWN,
    LOOP,
    TASK,
    _load_file,
    _text,
    check_command_line,
    episode_runs,
    recorded_server,
    short_training_run,
)
from test_frameworks import script as native_script

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, SYSTEM_PROMPT
from swarmkit.timelines.merging import merge_timelines

#: example module -> the packages it imports
FRAMEWORKS: dict[str, list[str]] = {
    "litellm_sdk": ["litellm"],
    "autogen_agent": ["autogen_agentchat", "autogen_ext.models.openai"],
    "llamaindex_agent": ["llama_index.core", "llama_index.llms.openai_like"],
    "llamaindex_responses": ["llama_index.core", "llama_index.llms.openai"],
    "smolagents_tool_calling": ["smolagents"],
    "smolagents_code": ["smolagents"],
    "dspy_react": ["dspy"],
    "google_adk_agent": ["google.adk", "litellm"],
}
NAMES = list(FRAMEWORKS)


def _missing(name: str) -> list[str]:
    """The packages of a recipe that are not installed (found without importing them)."""
    return [p for p in FRAMEWORKS[name] if importlib.util.find_spec(p.split(".")[0]) is None]


#: NAMES as test parameters: a recipe whose framework is missing is skipped before the module's
#: servers start (README's test command runs this file in a venv without these frameworks), unless
#: SWARMKIT_REQUIRE_FRAMEWORKS=1 (CI's agents-more step), where its test fails
PARAMS = [pytest.param(n, marks=pytest.mark.skipif(
    bool(_missing(n)) and os.environ.get("SWARMKIT_REQUIRE_FRAMEWORKS") != "1",
    reason=f"examples/frameworks/{n}.py needs {', '.join(_missing(n))}: pip install -e '.[agents-more]'"))
    for n in NAMES]
# a recipe may import another of its folder (as when it runs as a script)
sys.path.insert(0, str(EXAMPLES))
#: the prompt templates (test_frameworks.TEMPLATES): the tiny model's own and SmolLM2's
TEMPLATES = ["builtin:tiny", "builtin:smollm2_tools"]
#: smolagents' and DSPy's prompts (their instructions and examples: 6.7k tokens for CodeAgent, 2.9k for
#: ToolCallingAgent, 2.1k for ReAct under the tiny tokenizer) need more than the tiny model's 1024: a
#: user raises model.max_context the same way
MAX_CONTEXT = 8192


def load(name: str):
    """An example module (its framework's import errors surface here)."""
    return _load_file(name)


# --------------------------------------------------------------------------- the scripted model
_CODE = "Thought: I will use the calculator.\n<code>\nprint(calculator(expression=\"%s\"))\n</code>"
_CODE_BAD = "Thought: I will use the calculator.\n<code>\nprint(calculator(value=\"1\"))\n</code>"
_CODE_ANSWER = "Thought: I have the result.\n<code>\nfinal_answer(\"<answer>%s</answer>\")\n</code>"
_FINAL = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "<answer>%s</answer>"}}\n</tool_call>'


def _task_of(prompt: str) -> Task | None:
    for task in (*KNOWN, LOOP):
        if task.messages[1]["content"] in prompt:
            return task
    return None


def script(prompt: str) -> str:
    """The model, in the idiom the prompt asks for; with a tool call's opening prefilled by the server
    (``tool_choice: "required"``), the rest of the call."""
    reply = _reply(prompt)
    if prompt.endswith(_OPENING) and _OPENING in reply:
        return reply.split(_OPENING, 1)[1]
    return reply


#: where the server's prefilled tool-call opening ends (tool_choice "required"), under both templates
_OPENING = '{"name": "'


def _reply(prompt: str) -> str:
    """The whole reply (test_frameworks.script for native tool calls)."""
    task, loop, bad = _task_of(prompt), "LOOP" in prompt, "BADARGS" in prompt
    if "[[ ## trajectory ## ]]" in prompt:  # dspy.ReAct: a step, or the final extraction
        observations = [o for o in re.findall(r"\[\[ ## observation_\d+ ## \]\]\n(.*?)\n\n", prompt, re.S)
                        if o != "Completed."]  # (what `finish` returns)
        outputs = prompt.split("Your output fields are:", 1)[1].split("All interactions", 1)[0]
        json_reply = "Outputs will be a JSON object" in prompt  # DSPy's JSONAdapter: its retry
        last = observations[-1] if observations else "nothing"
        if "`answer`" in outputs:
            fields = {"reasoning": f"The calculator said {last}.", "answer": f"<answer>{last}</answer>"}
        elif observations and not loop:
            fields = {"next_thought": "I have the result.", "next_tool_name": "finish", "next_tool_args": {}}
        else:
            fields = {"next_thought": "I will use the calculator.", "next_tool_name": "calculator",
                      "next_tool_args": {"value": "1"} if bad else {"expression": task.meta["expression"] if task else "0"}}
        if json_reply:
            return json.dumps(fields)
        return "".join(f"[[ ## {k} ## ]]\n{v if isinstance(v, str) else json.dumps(v)}\n\n" for k, v in fields.items()) \
            + "[[ ## completed ## ]]"
    if "final_answer(" in prompt and "<code>" in prompt:  # smolagents' CodeAgent (its examples before the task)
        observations = re.findall(r"Observation:\n(?:Execution logs:\n)?(.*?)\n", prompt.rsplit("New task:", 1)[-1])
        if observations and not loop:
            return _CODE_ANSWER % observations[-1].strip()
        return _CODE_BAD if bad else _CODE % (task.meta["expression"] if task else "0")
    if '"final_answer"' in prompt:  # smolagents' ToolCallingAgent: its answer is a tool call
        observations = re.findall(r"Observation:\n(.*?)(?:<\|im_end\|>|\n)", prompt)
        if observations and not loop:
            return _FINAL % observations[-1].strip()
    # (Google ADK sends a tool's result as {"result": ...})
    return re.sub(r'<answer>\{"result": "(.*)"\}</answer>', r"<answer>\1</answer>", native_script(prompt))


# --------------------------------------------------------------------------- the server
@pytest.fixture(scope="module", params=TEMPLATES)
def server(request, tmp_path_factory):
    with recorded_server(script, request.param, tmp_path_factory.mktemp("frameworks_more"),
                         [f"model.max_context={MAX_CONTEXT}"]) as served:
        yield served


@pytest.fixture(scope="module")
def runs(server):
    """One episode per (framework, task), shared by the tests."""
    return episode_runs(server, lambda name: (_load_file(name) if name == "raw_httpx" else load(name)).run_episode)


# --------------------------------------------------------------------------- what each framework does
#: model calls of the calc episode (DSPy: a ReAct step that calls the tool, one that picks `finish`,
#: then the extraction of the answer)
TURNS = {name: 3 if name == "dspy_react" else 2 for name in NAMES}
#: frameworks that send their history back as text (smolagents: "Calling tools: [...]" and
#: "Observation: ..." turns; DSPy: the trajectory inside one user message): each call is its own sample
OWN_SAMPLES = ("smolagents_tool_calling", "smolagents_code", "dspy_react")
#: the request fields each framework sends beyond model/messages/tools (pinned; listed in the README)
WIRE: dict[str, dict[str, Any]] = {
    "litellm_sdk": {"max_tokens": 64, "seed": 7, "temperature": 1.0},
    "autogen_agent": {"max_tokens": 64, "seed": 7, "temperature": 1.0, "stream": False, "tool_choice": "auto"},
    "llamaindex_agent": {"max_tokens": 64, "seed": 7, "temperature": 1.0, "stream": True, "tool_choice": "auto",
                         "parallel_tool_calls": True},
    "llamaindex_responses": {"max_output_tokens": 64, "temperature": 1.0, "stream": True, "tool_choice": "auto",
                             "parallel_tool_calls": True, "store": False, "top_p": 1.0, "truncation": "disabled",
                             "previous_response_id": None, "include": None, "metadata": None, "user": None},
    "smolagents_tool_calling": {"max_tokens": 64, "seed": 7, "temperature": 1.0, "tool_choice": "required",
                                "stop": ["Observation:", "Calling tools:"]},
    "smolagents_code": {"max_tokens": 128, "seed": 7, "temperature": 1.0,
                        "stop": ["Observation:", "Calling tools:", "</code>"]},
    "dspy_react": {"max_completion_tokens": 128, "seed": 7, "temperature": 1.0},
    "google_adk_agent": {"max_completion_tokens": 64, "seed": 7, "temperature": 1.0},
}
#: the tool each sends (None: described in its prompt's text, called in the reply's own format)
TOOL_PARAMETERS: dict[str, dict[str, Any] | None] = {
    "litellm_sdk": CALCULATOR_TOOL["function"]["parameters"],
    "autogen_agent": {"type": "object", "properties": {"expression": {
        "description": "expression", "title": "Expression", "type": "string"}},
        "required": ["expression"], "additionalProperties": False},
    "llamaindex_agent": {"properties": {"expression": {"title": "Expression", "type": "string"}},
                         "required": ["expression"], "type": "object", "additionalProperties": False},
    "llamaindex_responses": {"properties": {"expression": {"title": "Expression", "type": "string"}},
                             "required": ["expression"], "type": "object"},
    "smolagents_tool_calling": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "the arithmetic expression"}}, "required": ["expression"]},
    "smolagents_code": None,
    "dspy_react": None,
    "google_adk_agent": {"properties": {"expression": {"title": "Expression", "type": "string"}},
                         "required": ["expression"], "title": "calculatorParams", "type": "object"},
}


def _tools(body: dict) -> list[dict]:
    """A request's function tools, in the chat-completions shape."""
    return [t if "function" in t else {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
            for t in body.get("tools", [])]


def _messages(body: dict) -> list[tuple[str, str]]:
    """A request's (role, text) turns, its instructions first (Responses)."""
    turns = [("system", body["instructions"])] if body.get("instructions") else []
    for m in body.get("messages", body.get("input", [])):
        if "role" in m:
            turns.append((m["role"], _text(m.get("content") or "")))
    return turns


# --------------------------------------------------------------------------- (a) the episode
@pytest.mark.parametrize("name", PARAMS)
def test_the_episode_ends_with_the_right_answer(runs, name):
    run = runs(name)
    assert run.result == (f"<answer>{TASK.answer}</answer>", 1, 1, TURNS[name])
    assert run.reward == pytest.approx(1.1)
    assert run.report["accepted"] is True and run.report["reward"] == pytest.approx(1.1)


# --------------------------------------------------------------------------- (b) the capture
@pytest.mark.parametrize("name", PARAMS)
def test_every_model_call_is_captured(runs, server, name):
    """One timeline per model call, each ending with the model's reply (the trained tokens); the
    native tool-calling agents' calls merge into one sample, the others' stay one sample each."""
    run = runs(name)
    assert len(run.bodies) == len(run.timelines) == TURNS[name]
    for tl in run.timelines:
        reply = tl.blocks[-1]
        # only the reply is trained (smolagents: not the tool-call opening the server prefills for its
        # tool_choice "required")
        assert reply.author == "llm" and sum(reply.loss_mask) > 0
        assert not any(m for b in tl.blocks[:-1] for m in b.loss_mask)
    assert TASK.answer in server.tokenizer.decode(run.timelines[-1].blocks[-1].token_ids)
    samples = merge_timelines(run.timelines, "token")
    assert len(samples) == (TURNS[name] if name in OWN_SAMPLES else 1)


@pytest.mark.skipif(importlib.util.find_spec("litellm") is None and os.environ.get("SWARMKIT_REQUIRE_FRAMEWORKS") != "1",
                    reason="examples/frameworks/litellm_sdk.py needs litellm: pip install -e '.[agents-more]'")
def test_litellm_is_token_identical_to_raw_httpx(runs):
    """LiteLLM sends the reference's messages and tool: the same prompts, token for token (the others
    send tool schemas of their own, or their own prompts: README)."""
    assert [tl.token_ids() for tl in runs("litellm_sdk").timelines] == \
        [tl.token_ids() for tl in runs("raw_httpx").timelines]


# --------------------------------------------------------------------------- (c) what is sent
@pytest.mark.parametrize("name", PARAMS)
def test_the_requests_carry_the_task_prompt_and_tool(runs, name):
    question = TASK.messages[1]["content"]
    for body in runs(name).bodies:
        turns = _messages(body)
        # the task's system prompt: as is, or inside the framework's own instructions
        assert turns[0][0] in ("system", "developer") and SYSTEM_PROMPT in turns[0][1]
        assert any(role == "user" and question in text for role, text in turns)
        assert {k: body.get(k) for k in WIRE[name]} == WIRE[name]
        params = TOOL_PARAMETERS[name]
        if params is None:  # the tool lives in the prompt's text
            assert "tools" not in body and "calculator" in turns[0][1]
            continue
        calculator = [t["function"] for t in _tools(body) if t["function"]["name"] == "calculator"]
        assert len(calculator) == 1, body.get("tools")
        assert calculator[0]["description"] == CALCULATOR_TOOL["function"]["description"]
        assert calculator[0]["parameters"] == params
        assert calculator[0].get("strict") in (None, False)  # never "strict": true (the server refuses it)
    if name == "smolagents_tool_calling":
        assert [t["function"]["name"] for t in _tools(body)] == ["calculator", "final_answer"]
    if name == "google_adk_agent":  # ADK adds a line naming the agent, and sends results as {"result": ...}
        assert turns[0][1] == SYSTEM_PROMPT + '\n\nYou are an agent. Your internal name is "calc".'
        assert turns[-1] == ("tool", json.dumps({"result": TASK.answer}))


# --------------------------------------------------------------------------- (d) limits and errors
#: the loop task's outcome at the 3-call limit: (final text, valid calls, calls)
AT_LIMIT = {name: ("", 3, 3) for name in NAMES} | {
    # smolagents' last call is its forced final call (no tools): its reply's text is the answer
    "smolagents_tool_calling": (CALL % LOOP.meta["expression"], 2, 2),
    "smolagents_code": (CALL % LOOP.meta["expression"], 2, 2),
    # DSPy's last call extracts an answer from the trajectory, whatever the steps did
    "dspy_react": (f"<answer>{LOOP.answer}</answer>", 2, 2),
}


@pytest.mark.parametrize("name", PARAMS)
def test_the_agent_stops_after_three_model_calls(runs, name):
    run = runs(name, LOOP)
    assert run.result == (*AT_LIMIT[name], 3)
    assert len(run.bodies) == len(run.timelines) == 3


@pytest.mark.parametrize("name", PARAMS)
def test_a_malformed_tool_call_is_answered_with_an_error_not_a_crash(runs, name):
    """The model's wrong argument names come back to it as an error (the framework's validation or
    the calculator's): the episode goes on and is reported, no reward for the call."""
    run = runs(name, BAD_ARGS)
    final, valid, calls, turns = run.result
    assert valid == 0 and turns == len(run.bodies) <= 4
    assert run.report["accepted"] is True and run.reward == 0.0
    if name not in ("smolagents_code", "dspy_react"):  # (CodeAgent: Python's TypeError, the tool never runs)
        assert calls >= 1


@pytest.mark.parametrize("name", PARAMS)
def test_the_command_line_trains_and_evaluates_with_episodes_at_once(server, capsys, name):
    check_command_line(server, capsys, name, load(name))


# --------------------------------------------------------------------------- (e) the tiny model
@pytest.mark.slow
@pytest.mark.parametrize("name", PARAMS)
def test_a_short_training_run_on_the_tiny_model(name, tmp_path):
    """Episodes of the framework on the tiny random model (hf backend): every call captured, two GRPO
    steps, finite losses. A random model rarely follows a framework's format: the episodes end early
    or at the limit, which is what training starts from."""
    # (CodeAgent's episodes, ~7k-token prompts under the tiny tokenizer, may outlast the default 60 s drain
    # before a step on a busy CPU: an episode still running then is aborted)
    outcomes = short_training_run(load(name), tmp_path, [f"model.max_context={MAX_CONTEXT}",
                                                         "server.drain_timeout_s=600"], step_timeout_s=300)
    assert all(1 <= o.metrics["turns"] <= 4 for o in outcomes)

