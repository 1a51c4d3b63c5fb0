"""calc_agent with the official ``anthropic`` SDK: a Messages API tool loop (``tool_use`` / ``tool_result``).

The Anthropic SDK adds ``/v1/messages`` to its ``base_url``, so it takes the server's root (registration's
``anthropic_base_url``; :func:`run_episode` gets the OpenAI-style ``base_url`` and strips its ``/v1``). The
episode key goes as ``x-api-key``, as the SDK sends it.

    python examples/frameworks/anthropic_sdk.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

from anthropic import Anthropic

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, run_tool_call

TOOL = {"name": "calculator", "description": CALCULATOR_TOOL["function"]["description"],
        "input_schema": CALCULATOR_TOOL["function"]["parameters"]}


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    llm = Anthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    messages: list = [{"role": "user", "content": question}]
    valid = calls = turns = 0
    # the SDK's create() has no sampling arguments any more (the server samples at temperature 1 by default,
    # and still reads temperature / top_p in the body); Messages has no seed
    sampling = {} if temperature == 1.0 else {"extra_body": {"temperature": min(temperature, 1.0)}}
    for turns in range(1, max_turns + 1):
        reply = llm.messages.create(model="swarm", system=system, messages=messages, tools=[TOOL],
                                    max_tokens=max_tokens, **sampling)
        messages.append({"role": "assistant", "content": reply.content})  # the SDK's blocks, sent back as they are
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in reply.content if b.type == "text"), valid, calls, turns
        results = []
        for use in uses:
            result, ok = run_tool_call(use.name, use.input)
            valid, calls = valid + ok, calls + 1
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": result})
        messages.append({"role": "user", "content": results})
    return "", valid, calls, turns


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "anthropic SDK")
