"""calc_agent in Google ADK: an ``LlmAgent`` with a function tool, on ADK's ``LiteLlm`` model wrapper
(LiteLLM's "openai/" provider: chat completions to any OpenAI-compatible server).

    pip install google-adk litellm
    python examples/frameworks/google_adk_agent.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM fetches a price list at import

from google.adk.agents import LlmAgent  # noqa: E402
from google.adk.agents.invocation_context import LlmCallsLimitExceededError  # noqa: E402
from google.adk.agents.run_config import RunConfig  # noqa: E402
from google.adk.models.lite_llm import LiteLlm  # noqa: E402
from google.adk.runners import InMemoryRunner  # noqa: E402
from google.genai import types  # noqa: E402

from swarmkit.tasks import Task  # noqa: E402
from swarmkit.tasks.calc_agent import call_calculator, run_tool_call  # noqa: E402


def calculator(expression: str) -> str:
    """Evaluate arithmetic, e.g. 347 * 86"""
    return call_calculator(expression=expression)


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    return asyncio.run(_run(base_url, api_key, task, temperature, seed, max_tokens, max_turns))


async def _run(base_url: str, api_key: str, task: Task, temperature: float, seed: int | None, max_tokens: int,
               max_turns: int) -> tuple[str, int, int, int]:
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    model = LiteLlm(model="openai/swarm", api_base=base_url, api_key=api_key, num_retries=0)
    config = types.GenerateContentConfig(temperature=temperature, max_output_tokens=max_tokens, seed=seed)
    # a plain function is the tool: ADK builds its schema from the signature and docstring
    agent = LlmAgent(name="calc", model=model, instruction=system, tools=[calculator],
                     generate_content_config=config)
    runner = InMemoryRunner(agent=agent, app_name="calc_agent")
    session = await runner.session_service.create_session(app_name="calc_agent", user_id="swarm")
    message = types.Content(role="user", parts=[types.Part(text=question)])
    replies: list[list[types.Part]] = []  # the parts of each model reply
    try:
        async for event in runner.run_async(user_id="swarm", session_id=session.id, new_message=message,
                                            run_config=RunConfig(max_llm_calls=max_turns)):
            if event.author == "calc" and event.content and not event.get_function_responses():
                replies.append(list(event.content.parts or []))
    except LlmCallsLimitExceededError:  # a model call after max_turns
        pass
    finally:
        await runner.close()
    calls = [run_tool_call(p.function_call.name or "", p.function_call.args or {})[1]
             for parts in replies for p in parts if p.function_call]
    last = replies[-1] if replies else []
    final = "" if any(p.function_call for p in last) else "".join(p.text or "" for p in last)
    return final, sum(calls), len(calls), len(replies)


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "Google ADK")
