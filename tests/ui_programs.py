"""A workflow program for the `masenvs ui` tests: solve, then check, and the user's own code
fails after the check in run 0 of each task (the viewer shows the failure and its cause)."""

from __future__ import annotations

from typing import Any

from masenvs.adapters.frameworks import WorkflowContext


def solve_check_fails_first_run(ctx: WorkflowContext) -> Any:
    from langchain_core.messages import HumanMessage
    from langgraph.graph import END, START, MessagesState, StateGraph

    solver, checker = ctx.clients["solver"], ctx.clients["checker"]

    async def solve(state: MessagesState) -> dict:
        return {"messages": [await solver.ainvoke(state["messages"])]}

    async def check(state: MessagesState) -> dict:
        reply = await checker.ainvoke([HumanMessage(f"Check: {state['messages'][-1].text}")])
        if ctx.run_index == 0:
            raise ValueError("the checker's verdict could not be parsed")
        return {"messages": [reply]}

    graph = StateGraph(MessagesState)
    graph.add_node("solve", solve)
    graph.add_node("check", check)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "check")
    graph.add_edge("check", END)
    return graph.compile()
