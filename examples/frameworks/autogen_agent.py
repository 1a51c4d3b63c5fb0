"""calc_agent in AutoGen (AgentChat): an ``AssistantAgent`` with a ``FunctionTool`` on ``OpenAIChatCompletionClient``.

    pip install autogen-agentchat "autogen-ext[openai]"
    python examples/frameworks/autogen_agent.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

import asyncio

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import TextMessage, ToolCallRequestEvent
from autogen_core.tools import FunctionTool
from autogen_ext.models.openai import OpenAIChatCompletionClient

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, calculator, run_tool_call

# the schema comes from the signature: {"expression": {"title": "Expression", "type": "string"}} and
# "additionalProperties": false (the server renders it as sent)
calculator_tool = FunctionTool(calculator, name="calculator", description=CALCULATOR_TOOL["function"]["description"])
#: what AutoGen needs to know of a model it has no table entry for
MODEL_INFO = {"vision": False, "function_calling": True, "json_output": False, "structured_output": False,
              "family": "unknown"}


async def _run(base_url: str, api_key: str, task: Task, temperature: float, seed: int | None, max_tokens: int,
               max_turns: int) -> tuple[str, int, int, int]:
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    client = OpenAIChatCompletionClient(model="swarm", base_url=base_url, api_key=api_key, model_info=MODEL_INFO,
                                        temperature=temperature, max_tokens=max_tokens, max_retries=0,
                                        **({"seed": seed} if seed is not None else {}))
    # max_tool_iterations: a model call after each tool call, up to max_turns calls; no reflection call
    # (reflect_on_tool_use=False: at the limit the reply is a summary of the tool results, not the model's)
    agent = AssistantAgent("calc", model_client=client, tools=[calculator_tool], system_message=system,
                           max_tool_iterations=max_turns, reflect_on_tool_use=False)
    try:
        result = await agent.run(task=question)
    finally:
        await client.close()
    requests = [m for m in result.messages if isinstance(m, ToolCallRequestEvent)]
    calls = [run_tool_call(c.name, c.arguments)[1] for m in requests for c in m.content]
    last = result.messages[-1]
    final = last.content if isinstance(last, TextMessage) and last.source == "calc" else ""
    return final, sum(calls), len(calls), len(requests) + bool(final)


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    return asyncio.run(_run(base_url, api_key, task, temperature, seed, max_tokens, max_turns))


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "AutoGen")
