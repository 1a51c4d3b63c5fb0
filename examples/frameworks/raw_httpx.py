"""calc_agent over raw HTTP (``httpx`` only): the chat-completions protocol by hand.

The reference the other examples are compared with (it is what
``swarmkit.tasks.calc_agent.run_calc_episode`` and the main job send).

    python examples/frameworks/raw_httpx.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

import httpx

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, run_tool_call


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    messages = [dict(m) for m in task.messages]  # the system prompt and the word problem
    valid = calls = turns = 0
    with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=600) as http:
        for turns in range(1, max_turns + 1):
            body = {"model": "swarm", "messages": messages, "tools": [CALCULATOR_TOOL],
                    "temperature": temperature, "max_tokens": max_tokens}
            if seed is not None:
                body["seed"] = seed
            r = http.post("/chat/completions", json=body)
            r.raise_for_status()
            msg = r.json()["choices"][0]["message"]
            messages.append({"role": "assistant", "content": msg.get("content"),
                             **({"tool_calls": msg["tool_calls"]} if msg.get("tool_calls") else {})})
            if not msg.get("tool_calls"):
                return msg.get("content") or "", valid, calls, turns
            for call in msg["tool_calls"]:
                result, ok = run_tool_call(call["function"]["name"], call["function"]["arguments"])
                valid, calls = valid + ok, calls + 1
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    return "", valid, calls, turns


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "raw httpx")
