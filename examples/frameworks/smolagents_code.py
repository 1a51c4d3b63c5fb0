"""calc_agent in smolagents: a ``CodeAgent`` (the model writes Python that calls the tool) on ``OpenAIModel``.

    pip install smolagents
    python examples/frameworks/smolagents_code.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32

Its prompt (instructions and worked examples) is ~2.4k tokens under SmolLM2's tokenizer: the server's
model.max_context (2048 by default) must hold it and the replies (e.g. model.max_context=4096).
"""

from __future__ import annotations

from smolagents import ActionStep, CodeAgent, OpenAIModel, tool

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import run_tool_call


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 128, max_turns: int = 3) -> tuple[str, int, int, int]:
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    # the model's code calls the tool, so the tool counts the calls (a call with wrong argument names
    # fails in Python before reaching it: the model sees the TypeError)
    calls: list[bool] = []

    @tool
    def calculator(expression: str) -> str:
        """Evaluate arithmetic, e.g. 347 * 86

        Args:
            expression: the arithmetic expression
        """
        result, ok = run_tool_call("calculator", {"expression": expression})
        calls.append(ok)
        return result

    model = OpenAIModel(model_id="swarm", api_base=base_url, api_key=api_key, temperature=temperature,
                        max_tokens=max_tokens, client_kwargs={"max_retries": 0},
                        **({"seed": seed} if seed is not None else {}))
    # smolagents' own system prompt with the task's appended; the code runs in its local interpreter,
    # and the answer is the argument of its `final_answer(...)`; after max_steps it makes one more call
    # for an answer (its reply's text): max_steps = max_turns - 1
    agent = CodeAgent(tools=[calculator], model=model, instructions=system, max_steps=max_turns - 1,
                      verbosity_level=0)
    result = agent.run(question, return_full_result=True)
    steps = [s for s in agent.memory.steps if isinstance(s, ActionStep)]  # one per model call
    final = "" if result.output is None else str(result.output)
    return final, sum(calls), len(calls), len(steps)


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "smolagents CodeAgent")
