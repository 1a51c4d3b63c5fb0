"""calc_agent in DSPy: a ``dspy.ReAct`` module (question -> answer) with one tool, on ``dspy.LM``
(LiteLLM's "openai/" provider: chat completions to any OpenAI-compatible server).

    pip install dspy
    python examples/frameworks/dspy_react.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM fetches a price list at import

from typing import Any  # noqa: E402

import dspy  # noqa: E402
from dspy.utils.callback import BaseCallback  # noqa: E402
from dspy.utils.exceptions import AdapterParseError  # noqa: E402

from swarmkit.tasks import Task  # noqa: E402
from swarmkit.tasks.calc_agent import call_calculator, run_tool_call  # noqa: E402


def calculator(expression: str) -> str:
    """Evaluate arithmetic, e.g. 347 * 86"""
    return call_calculator(expression=expression)


class _Steps(BaseCallback):
    """The tool calls ReAct makes (each tool's start: its name and arguments)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def on_tool_start(self, call_id: str, instance: Any, inputs: dict[str, Any]) -> None:
        self.calls.append((instance.name, inputs.get("kwargs", {})))


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 128, max_turns: int = 3) -> tuple[str, int, int, int]:
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    # cache=False: DSPy caches LM answers by request, so a repeated prompt would never reach the server
    lm = dspy.LM("openai/swarm", api_base=base_url, api_key=api_key, temperature=temperature,
                 max_tokens=max_tokens, cache=False, num_retries=0, **({"seed": seed} if seed is not None else {}))
    # ReAct's steps (thought, tool name, tool args, as DSPy's [[ ## field ## ]] text, no native tool
    # calls), then one more call that extracts the answer: max_iters = max_turns - 1 model calls
    agent = dspy.ReAct(dspy.Signature("question -> answer", system), tools=[calculator], max_iters=max_turns - 1)
    # ReAct records its steps in a trajectory it hands back with the answer, or keeps in a local
    # when the answer cannot be parsed: a callback sees each step's tool call
    steps = _Steps()
    final = ""
    with dspy.context(lm=lm, callbacks=[steps]):  # per episode (dspy.configure is process-wide)
        try:
            final = str(agent(question=question).answer or "")
        except AdapterParseError:  # the model's last reply is not in DSPy's format: no answer
            pass
    calls = [run_tool_call(name, args)[1] for name, args in steps.calls if name != "finish"]
    return final, sum(calls), len(calls), len(lm.history)


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "DSPy")
