"""calc_agent in LlamaIndex: a ``FunctionAgent`` workflow on ``OpenAILike`` (chat completions) with one tool.

    pip install llama-index-core llama-index-llms-openai-like
    python examples/frameworks/llamaindex_agent.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.agent.workflow import AgentOutput, FunctionAgent
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.tools import FunctionTool
from llama_index.llms.openai_like import OpenAILike

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, calculator, run_tool_call

# the schema comes from the signature ({"expression": {"title": "Expression", "type": "string"}});
# the description is sent as given
calculator_tool = FunctionTool.from_defaults(calculator, name="calculator",
                                             description=CALCULATOR_TOOL["function"]["description"])


def make_llm(base_url: str, api_key: str, temperature: float, seed: int | None, max_tokens: int) -> OpenAILike:
    """``OpenAILike``: say it is a chat model with function calling (it knows nothing of "swarm")."""
    return OpenAILike(model="swarm", api_base=base_url, api_key=api_key, is_chat_model=True,
                      is_function_calling_model=True, context_window=2048, temperature=temperature,
                      max_tokens=max_tokens, max_retries=0,
                      additional_kwargs={"seed": seed} if seed is not None else {})


async def run_agent(llm: FunctionCallingLLM, task: Task, max_turns: int) -> tuple[str, int, int, int]:
    """The agent on ``llm``: its replies are read from the workflow's event stream."""
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    agent = FunctionAgent(tools=[calculator_tool], llm=llm, system_prompt=system)
    # max_iterations counts model replies and raises on reaching it, even on a reply with the answer:
    # one more than max_turns, and the run is cancelled once the max_turns-th reply still calls a tool
    handler = agent.run(question, max_iterations=max_turns + 1)
    replies: list[list[ToolSelection]] = []  # the tool calls of each model reply
    async for event in handler.stream_events():
        if isinstance(event, AgentOutput):  # (a copy: the last one's list gets the run's tool results)
            replies.append(list(event.tool_calls))
            if len(replies) == max_turns and event.tool_calls:
                await handler.cancel_run()
                break
    result: Any = None if replies and replies[-1] else await handler
    calls = [run_tool_call(c.tool_name, c.tool_kwargs)[1] for r in replies for c in r]
    final = str(result.response.content or "") if result is not None else ""
    return final, sum(calls), len(calls), len(replies)


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    llm = make_llm(base_url, api_key, temperature, seed, max_tokens)
    return asyncio.run(run_agent(llm, task, max_turns))


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "LlamaIndex")
