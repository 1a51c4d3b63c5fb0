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

import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import pytest
from test_frameworks import EXAMPLES, BAD_ARGS, CALL, KNOWN, LOOP, TASK, TOKEN, Recorder, _load_file, _text
from test_frameworks import script as native_script

from swarmkit.client import SwarmClient
from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import SYSTEM_PROMPT, grade
from swarmkit.timelines import Timeline
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
# a recipe may import another of its folder (as when it runs as a script)
sys.path.insert(0, str(EXAMPLES))
#: the prompt templates (test_frameworks.TEMPLATES): the tiny model's own and SmolLM2's
TEMPLATES = ["builtin:tiny", "builtin:smollm2_tools"]
#: smolagents' CodeAgent prompt (~2.3k tokens of instructions and examples) needs more than the tiny
#: model's 1024: a user raises model.max_context the same way
MAX_CONTEXT = 8192


def load(name: str):
    """An example module (skipped when its framework is not installed, failed under SWARMKIT_REQUIRE_FRAMEWORKS)."""
    for package in FRAMEWORKS[name]:
        if os.environ.get("SWARMKIT_REQUIRE_FRAMEWORKS") == "1":
            __import__(package)
        else:
            pytest.importorskip(package, reason=f"examples/frameworks/{name}.py needs {package}: "
                                                "pip install -e '.[agents-more]'")
    return _load_file(name)


# --------------------------------------------------------------------------- the scripted model
_CODE = "Thought: I will use the calculator.\n<code>\nprint(calculator(expression=\"%s\"))\n</code>"
_CODE_BAD = "Thought: I will use the calculator.\n<code>\nprint(calculator(value=\"1\"))\n</code>"
_CODE_ANSWER = "Thought: I have the result.\n<code>\nfinal_answer(\"<answer>%s</answer>\")\n</code>"
_FINAL = '<tool_call>\n{"name": "final_answer", "arguments": {"answer": "<answer>%s</answer>"}}\n</tool_call>'
_REACT = ("[[ ## next_thought ## ]]\nI will use the calculator.\n\n[[ ## next_tool_name ## ]]\n%s\n\n"
          "[[ ## next_tool_args ## ]]\n%s\n\n[[ ## completed ## ]]")
_EXTRACT = "[[ ## reasoning ## ]]\nThe calculator said %s.\n\n[[ ## answer ## ]]\n<answer>%s</answer>\n\n[[ ## completed ## ]]"


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
    if "[[ ## next_thought ## ]]" in prompt:  # dspy.ReAct: a step, or the final extraction
        observations = re.findall(r"\[\[ ## observation_\d+ ## \]\]\n(.*?)\n\n", prompt, re.S)
        if "[[ ## answer ## ]]" in prompt.rsplit("Your input fields are", 1)[-1].split("[[ ## trajectory", 1)[0] \
                and "next_thought" not in prompt.rsplit("<|im_start|>system", 1)[-1].split("Your output fields", 1)[-1][:200]:
            return _EXTRACT % (observations[-1], observations[-1])
        if observations and not loop:
            return _REACT % ("finish", "{}")
        args = {"value": "1"} if bad else {"expression": task.meta["expression"] if task else "0"}
        return _REACT % ("calculator", json.dumps(args))
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
@dataclass
class Server:
    client: SwarmClient
    recorder: Recorder
    tokenizer: Any
    template: str


@pytest.fixture(scope="module", params=TEMPLATES)
def server(request, tmp_path_factory):
    from swarmkit.apps.wiring import build_server
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.plugins import get_registry
    from swarmkit.server.run import run_in_thread
    from swarmkit.testing.scripted import ScriptedBackend

    tok = build_tiny_tokenizer()
    backend = ScriptedBackend(tok, replies=lambda ids: script(tok.decode(ids)))
    config = validate_config(compose(["model=tiny", f"model.chat_template={request.param}",
                                      f"model.max_context={MAX_CONTEXT}"]), get_registry())
    srv, app = build_server({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("frameworks_more"))}},
                            train=False, config=config, backend_factory=lambda cfg: backend)
    recorder = Recorder(app)
    handle = run_in_thread(srv, recorder)
    client = SwarmClient(handle.url, token=TOKEN, retry_for=10)
    try:
        client.start()
        client.wait_for_state("ROLLING", timeout=30)
        yield Server(client, recorder, tok, request.param)
    finally:
        client.close()
        handle.stop()


@dataclass
class Run:
    result: tuple[str, int, int, int]
    reward: float
    report: dict
    timelines: list[Timeline]
    bodies: list[dict]


@pytest.fixture(scope="module")
def runs(server):
    """One episode per (framework, task), shared by the tests."""
    done: dict[tuple[str, str], Run] = {}

    def get(name: str, task: Task = TASK) -> Run:
        if (name, task.task_id) not in done:
            run_episode = load(name).run_episode
            with server.client.episode(task_id=task.task_id) as ep:
                result = run_episode(ep.base_url, ep.api_key, task, temperature=1.0, seed=7)
                outcome = grade(task, *result)
                report = ep.report(outcome.reward)
                timelines = ep.timelines(as_objects=True)
            done[name, task.task_id] = Run(result, outcome.reward, report, timelines,
                                           server.recorder.of(ep.api_key))
        return done[name, task.task_id]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_debug(runs, server, name):
    run = runs(name)
    print(json.dumps(run.bodies, indent=1)[:6000])
    for tl in run.timelines:
        print("----", server.tokenizer.decode(tl.token_ids()))
    print(run.result, run.reward)
