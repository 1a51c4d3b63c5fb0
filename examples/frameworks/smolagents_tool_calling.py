"""calc_agent in smolagents: a ``ToolCallingAgent`` (JSON tool calls) on ``OpenAIModel`` (chat completions).

    pip install smolagents
    python examples/frameworks/smolagents_tool_calling.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32
"""

from __future__ import annotations

from smolagents import ActionStep, OpenAIModel, ToolCallingAgent, tool

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import call_calculator, run_tool_call


@tool
def calculator(expression: str) -> str:
    """Evaluate arithmetic, e.g. 347 * 86

    Args:
        expression: the arithmetic expression
    """
    return call_calculator(expression=expression)


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    system, question = (m["content"] for m in task.messages)  # the system prompt and the word problem
    model = OpenAIModel(model_id="swarm", api_base=base_url, api_key=api_key, temperature=temperature,
                        max_tokens=max_tokens, client_kwargs={"max_retries": 0},
                        **({"seed": seed} if seed is not None else {}))
    # smolagents' own system prompt (its ReAct instructions and examples) with the task's appended;
    # the answer is a call of its `final_answer` tool; after max_steps it makes one more call, without
    # tools, for an answer (its reply's text): max_steps = max_turns - 1
    agent = ToolCallingAgent(tools=[calculator], model=model, instructions=system, max_steps=max_turns - 1,
                             verbosity_level=0)
    result = agent.run(question, return_full_result=True)
    steps = [s for s in agent.memory.steps if isinstance(s, ActionStep)]  # one per model call
    # the calls the model made (a step's `tool_calls` lacks those whose arguments failed validation)
    calls = [run_tool_call(c.function.name, c.function.arguments)[1] for s in steps if s.model_output_message
             for c in s.model_output_message.tool_calls or [] if c.function.name != "final_answer"]
    final = "" if result.output is None else str(result.output)
    return final, sum(calls), len(calls), len(steps)


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "smolagents")
