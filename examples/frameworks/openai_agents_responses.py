"""calc_agent with the OpenAI Agents SDK in its default mode: the Responses API.

The agent of ``openai_agents.py``, on the model class the SDK uses by default
(``OpenAIResponsesModel``), given a per-episode ``AsyncOpenAI`` client (a process-wide
``set_default_openai_client`` would send concurrent episodes to one key). Tracing is
turned off (it would upload to OpenAI).

    pip install openai-agents
    python examples/frameworks/openai_agents_responses.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32
"""

from __future__ import annotations

from agents import (
    Agent,
    FunctionTool,
    MaxTurnsExceeded,
    ModelBehaviorError,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    set_tracing_disabled,
)
from agents.items import ToolCallItem
from openai import AsyncOpenAI

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, run_tool_call


async def _calculator(ctx, arguments: str) -> str:
    return run_tool_call("calculator", arguments)[0]


# the task's own JSON schema, not strict (the server refuses strict schemas: it cannot constrain decoding)
calculator_tool = FunctionTool(name="calculator", description=CALCULATOR_TOOL["function"]["description"],
                               params_json_schema=CALCULATOR_TOOL["function"]["parameters"],
                               on_invoke_tool=_calculator, strict_json_schema=False)

set_tracing_disabled(True)


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    model = OpenAIResponsesModel(model="swarm", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key,
                                                                           max_retries=0))
    agent = Agent(name="calc", instructions=system, model=model, tools=[calculator_tool],
                  model_settings=ModelSettings(temperature=temperature, max_tokens=max_tokens))
    try:
        result = Runner.run_sync(agent, question, max_turns=max_turns)
        final, items, turns = str(result.final_output or ""), result.new_items, len(result.raw_responses)
    except (MaxTurnsExceeded, ModelBehaviorError) as exc:
        # still calling tools after max_turns, or a reply cut at max_tokens (Responses: status
        # "incomplete", which the SDK raises on): an episode without an answer
        data = getattr(exc, "run_data", None)
        final, items, turns = "", data.new_items if data else [], len(data.raw_responses) if data else max_turns
    calls = [run_tool_call(i.raw_item.name, i.raw_item.arguments)[1] for i in items if isinstance(i, ToolCallItem)]
    return final, sum(calls), len(calls), turns


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "OpenAI Agents SDK (Responses)")
