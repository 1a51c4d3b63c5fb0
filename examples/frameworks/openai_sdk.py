"""calc_agent with the official ``openai`` SDK: a plain chat-completions tool loop.

    python examples/frameworks/openai_sdk.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

from openai import OpenAI

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, run_tool_call


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    llm = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list = [dict(m) for m in task.messages]  # the system prompt and the word problem
    valid = calls = turns = 0
    for turns in range(1, max_turns + 1):
        reply = llm.chat.completions.create(
            model="swarm", messages=messages, tools=[CALCULATOR_TOOL], temperature=temperature,
            max_tokens=max_tokens, **({"seed": seed} if seed is not None else {}))
        msg = reply.choices[0].message
        messages.append(msg)  # the SDK serialises its own message object back
        if not msg.tool_calls:
            return msg.content or "", valid, calls, turns
        for call in msg.tool_calls:
            result, ok = run_tool_call(call.function.name, call.function.arguments)
            valid, calls = valid + ok, calls + 1
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return "", valid, calls, turns


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "openai SDK")
