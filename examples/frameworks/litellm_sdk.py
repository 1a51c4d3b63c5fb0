"""calc_agent with LiteLLM: a ``litellm.completion`` tool loop on an OpenAI-compatible endpoint.

    pip install litellm
    python examples/frameworks/litellm_sdk.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM fetches a price list at import

import litellm  # noqa: E402

from swarmkit.tasks import Task  # noqa: E402
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, run_tool_call  # noqa: E402


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    messages: list = [dict(m) for m in task.messages]  # the system prompt and the word problem
    valid = calls = turns = 0
    for turns in range(1, max_turns + 1):
        # "openai/<name>": LiteLLM's provider for any OpenAI-compatible server (api_base, api_key per call)
        reply = litellm.completion(
            model="openai/swarm", api_base=base_url, api_key=api_key, messages=messages, tools=[CALCULATOR_TOOL],
            temperature=temperature, max_tokens=max_tokens, num_retries=0,
            **({"seed": seed} if seed is not None else {}))
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return msg.content or "", valid, calls, turns
        for call in msg.tool_calls:
            result, ok = run_tool_call(call.function.name, call.function.arguments)
            valid, calls = valid + ok, calls + 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "", valid, calls, turns


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "LiteLLM")
