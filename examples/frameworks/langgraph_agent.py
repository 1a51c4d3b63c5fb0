"""calc_agent in LangGraph: a model node and a ``ToolNode`` in a ``StateGraph``, ``ChatOpenAI`` as the model.

    pip install langchain-openai langgraph
    python examples/frameworks/langgraph_agent.py --url http://127.0.0.1:8000 --token ADMIN --episodes 32 --eval 16
"""

from __future__ import annotations

from langchain_core.messages import AIMessage
from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

from swarmkit.tasks import Task
from swarmkit.tasks.calc_agent import CALCULATOR_TOOL, call_calculator, run_tool_call

# the task's own JSON schema (an @tool-decorated function would send a schema of its own)
calculator_tool = StructuredTool.from_function(
    call_calculator, name="calculator", description=CALCULATOR_TOOL["function"]["description"],
    args_schema=CALCULATOR_TOOL["function"]["parameters"])


def build_graph(llm: ChatOpenAI, max_turns: int):
    model = llm.bind_tools([calculator_tool])

    def agent(state: MessagesState) -> dict:
        return {"messages": [model.invoke(state["messages"])]}

    def route(state: MessagesState) -> str:
        turns = sum(isinstance(m, AIMessage) for m in state["messages"])
        return "tools" if state["messages"][-1].tool_calls and turns < max_turns else END

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode([calculator_tool]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", route, ["tools", END])
    graph.add_edge("tools", "agent")
    return graph.compile()


def run_episode(base_url: str, api_key: str, task: Task, *, temperature: float, seed: int | None,
                max_tokens: int = 64, max_turns: int = 3) -> tuple[str, int, int, int]:
    llm = ChatOpenAI(model="swarm", base_url=base_url, api_key=api_key, temperature=temperature, seed=seed,
                     max_tokens=max_tokens, max_retries=0)
    state = build_graph(llm, max_turns).invoke({"messages": task.messages})
    replies = [m for m in state["messages"] if isinstance(m, AIMessage)]
    calls = [run_tool_call(c["name"], c["args"]) for m in replies for c in m.tool_calls]
    calls += [(None, False) for m in replies for _ in m.invalid_tool_calls]
    final = replies[-1].text if replies and not replies[-1].tool_calls else ""
    return final, sum(ok for _, ok in calls), len(calls), len(replies)


if __name__ == "__main__":
    from swarm_loop import main

    main(run_episode, "LangGraph")
