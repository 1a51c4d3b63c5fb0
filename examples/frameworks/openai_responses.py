"""calc_agent with the ``openai`` SDK's Responses API: ``client.responses.create`` and function tools.

The first turn sends the task; each later turn sends only the tool results and ``previous_response_id``
(the server keeps the episode's responses), as Responses clients usually do.

    python examples/frameworks/openai_responses.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

from openai import OpenAI

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, run_tool_call

TOOL = {"type": "function", **CALCULATOR_TOOL["function"]}


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    llm = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    items: list = [{"role": "user", "content": question}]
    previous = None
    valid = calls = turns = 0
    for turns in range(1, max_turns + 1):
        reply = llm.responses.create(model="swarm", instructions=system, input=items, tools=[TOOL],
                                     temperature=temperature, max_output_tokens=max_tokens,
                                     previous_response_id=previous)
        uses = [it for it in reply.output if it.type == "function_call"]
        if not uses:
            return reply.output_text, valid, calls, turns
        previous, items = reply.id, []
        for use in uses:
            result, ok = run_tool_call(use.name, use.arguments)
            valid, calls = valid + ok, calls + 1
            items.append({"type": "function_call_output", "call_id": use.call_id, "output": result})
    return "", valid, calls, turns


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "openai Responses")
