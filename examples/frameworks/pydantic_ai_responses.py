"""calc_agent in Pydantic AI on the Responses API: the agent of ``pydantic_ai_agent.py`` on
``OpenAIResponsesModel`` instead of ``OpenAIChatModel``.

    pip install "pydantic-ai-slim[openai]"
    python examples/frameworks/pydantic_ai_responses.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32
"""

from __future__ import annotations

from pydantic_ai import Agent, Tool, UsageLimitExceeded, UsageLimits, capture_run_messages
from pydantic_ai.messages import ModelResponse, ToolCallPart
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, call_calculator, run_tool_call

# the task's own JSON schema, not strict (the server refuses strict schemas: it cannot constrain decoding)
calculator_tool = Tool.from_schema(call_calculator, name="calculator",
                                   description=CALCULATOR_TOOL["function"]["description"],
                                   json_schema=CALCULATOR_TOOL["function"]["parameters"])
calculator_tool.strict = False


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    model = OpenAIResponsesModel("swarm", provider=OpenAIProvider(base_url=base_url, api_key=api_key))
    agent = Agent(model, instructions=system, tools=[calculator_tool])
    settings = {"temperature": temperature, "max_tokens": max_tokens}  # Responses has no seed
    final = ""
    with capture_run_messages() as messages:
        try:
            final = agent.run_sync(question, model_settings=settings,
                                   usage_limits=UsageLimits(request_limit=max_turns)).output
        except UsageLimitExceeded:  # still calling tools after max_turns
            pass
    replies = [m for m in messages if isinstance(m, ModelResponse)]
    calls = [run_tool_call(p.tool_name, p.args)[1] for m in replies for p in m.parts if isinstance(p, ToolCallPart)]
    return final, sum(calls), len(calls), len(replies)


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "Pydantic AI (Responses)")
