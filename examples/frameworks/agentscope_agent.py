"""calc_agent in AgentScope 2.0: an ``Agent`` (its ReAct loop) with a ``Toolkit`` and ``OpenAIChatModel``.

    pip install agentscope
    python examples/frameworks/agentscope_agent.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

import asyncio

from agentscope.agent import Agent, InjectionConfig, ReActConfig
from agentscope.credential import OpenAICredential
from agentscope.message import UserMsg
from agentscope.middleware import MiddlewareBase
from agentscope.model import OpenAIChatModel
from agentscope.permission import PermissionBehavior, PermissionDecision
from agentscope.tool import FunctionTool, Toolkit

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, call_calculator, run_tool_call


class CountTurns(MiddlewareBase):
    """Counts the agent's model calls (its turns)."""

    turns = 0

    async def on_model_call(self, agent, input_kwargs, next_handler):
        self.turns += 1
        return await next_handler(**input_kwargs)


async def _run(base_url: str, api_key: str, task: Task, temperature: float, seed: int | None,
               max_tokens: int, max_turns: int) -> tuple[str, int, int, int]:
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    toolkit = Toolkit()
    await toolkit.add_tool(FunctionTool(
        call_calculator, name="calculator", description=CALCULATOR_TOOL["function"]["description"],
        input_schema=CALCULATOR_TOOL["function"]["parameters"],  # the task's own schema
        permission=PermissionDecision(behavior=PermissionBehavior.ALLOW, message="always allowed")))
    model = OpenAIChatModel(
        credential=OpenAICredential(api_key=api_key, base_url=base_url), model="swarm",
        max_retries=0, parameters=OpenAIChatModel.Parameters(temperature=temperature, max_tokens=max_tokens),
        extra_body={"seed": seed} if seed is not None else None)
    counter = CountTurns()
    agent = Agent(name="calc", system_prompt=system, model=model, toolkit=toolkit, middlewares=[counter],
                  # at the limit AgentScope makes one more, forced final call (a reminder, tool_choice "none")
                  react_config=ReActConfig(max_iters=max_turns - 1),
                  # no time-of-day hints in the context: the prompt stays a function of the task
                  injection_config=InjectionConfig(inject_runtime_state=False))
    try:
        final = await agent.reply(UserMsg(name="user", content=question))
    finally:
        await model.client.close()  # inside this event loop (asyncio.run closes it)
    blocks = [b for msg in agent.state.context for b in msg.get_content_blocks("tool_call")]
    calls = [run_tool_call(b.name, b.input)[1] for b in blocks]
    return final.get_text_content() or "", sum(calls), len(calls), counter.turns


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    return asyncio.run(_run(base_url, api_key, task, temperature, seed, max_tokens, max_turns))


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "AgentScope")
