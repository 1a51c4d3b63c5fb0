"""calc_agent with CrewAI: an ``Agent`` (role, goal, backstory) with a calculator ``BaseTool``, run by ``kickoff``.

CrewAI's native OpenAI provider speaks Chat Completions; ``LLM(model="openai/swarm", base_url=...)``
points it at the episode's endpoint. It sends every tool with ``"strict": true``: the server accepts it
and checks each call's arguments against the tool's schema after generation (a call that breaks it comes
back as generated and is reported in ``X-Swarm-Strict-Violations`` and the timeline's
``meta.strict_violations``; docs/server_api.md). CrewAI writes its own system prompt from the agent's
role, goal and backstory (the task's system prompt is the backstory) and asks for its answer format; its
telemetry and tracing are turned off (they would upload).

    pip install crewai     # into a venv of its own: it pins openai<3 and pydantic<2.13 (examples/frameworks/README.md)
    python examples/frameworks/crewai_agent.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

import os

for _name in ("CREWAI_DISABLE_TELEMETRY", "CREWAI_DISABLE_TRACKING", "OTEL_SDK_DISABLED"):
    os.environ.setdefault(_name, "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

import json  # noqa: E402
import threading  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Any  # noqa: E402

from crewai import LLM, Agent  # noqa: E402
from crewai.events import LLMCallStartedEvent, ToolUsageStartedEvent, crewai_event_bus  # noqa: E402
from crewai.tools import BaseTool  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from swarmkit.tasks import Task  # noqa: E402
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, run_tool_call  # noqa: E402

#: per episode: the LLM calls made (keyed by the episode's LLM object: the final-answer call names no
#: agent) and the tool calls (keyed by the agent's id; well-formed or not, counted as CrewAI starts them,
#: before it validates their arguments). CrewAI's event bus is process-wide and runs handlers on a thread
#: pool: episodes running side by side are told apart by these keys.
_seen: dict[str, list[Any]] = defaultdict(list)
_lock = threading.Lock()


@crewai_event_bus.on(LLMCallStartedEvent)
def _on_llm_call(source: Any, event: LLMCallStartedEvent) -> None:
    with _lock:
        _seen[f"llm-{id(source)}"].append(1)


@crewai_event_bus.on(ToolUsageStartedEvent)
def _on_tool_call(source: Any, event: ToolUsageStartedEvent) -> None:
    args = event.tool_args if isinstance(event.tool_args, str) else json.dumps(event.tool_args)
    with _lock:
        _seen[f"agent-{event.agent_id}"].append(run_tool_call(event.tool_name, args)[1])


class CalculatorInput(BaseModel):
    expression: str = Field(description="an arithmetic expression")


class Calculator(BaseTool):
    """The task's calculator (the agent's arguments are checked by CrewAI against ``args_schema`` first)."""

    name: str = "calculator"
    description: str = CALCULATOR_TOOL["function"]["description"]
    args_schema: type[BaseModel] = CalculatorInput

    def _run(self, expression: str) -> str:
        return run_tool_call("calculator", json.dumps({"expression": expression}))[0]


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    llm = LLM(model="openai/swarm", base_url=base_url, api_key=api_key, temperature=temperature,
              max_tokens=max_tokens, max_retries=0, **({"seed": seed} if seed is not None else {}))
    # max_iter tool-using iterations, then CrewAI forces one last call for a final answer (no tools offered)
    agent = Agent(role="calculator agent", goal="answer the word problem", backstory=system, llm=llm,
                  tools=[Calculator()], max_iter=max_turns - 1, allow_delegation=False, verbose=False)
    result = agent.kickoff(question)
    crewai_event_bus.flush()  # the handlers above have run
    with _lock:
        turns, calls = _seen.pop(f"llm-{id(llm)}", []), _seen.pop(f"agent-{agent.id}", [])
    return str(result.raw or ""), sum(calls), len(calls), len(turns)


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "CrewAI")
