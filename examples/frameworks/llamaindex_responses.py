"""calc_agent in LlamaIndex on the Responses API: the ``FunctionAgent`` of ``llamaindex_agent.py`` on
``OpenAIResponses`` instead of ``OpenAILike``.

    pip install llama-index-core llama-index-llms-openai
    python examples/frameworks/llamaindex_responses.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32
"""

from __future__ import annotations

import asyncio

from llama_index.llms.openai import OpenAIResponses
from llamaindex_agent import run_agent  # this folder (on sys.path when a script of it runs)

from swarmkit.tasks import Task


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    # the whole history goes back in `input` each turn (store=False, the default: nothing kept
    # server-side by previous_response_id); Responses has no seed
    llm = OpenAIResponses(model="swarm", api_base=base_url, api_key=api_key, temperature=temperature,
                          max_output_tokens=max_tokens, max_retries=0, context_window=2048)
    return asyncio.run(run_agent(llm, task, max_turns))


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "LlamaIndex (Responses)")
