"""A LangGraph solver + verifier team on math, trained with masenvs.

The graph is ordinary LangGraph: a `solver` node answers, a `verifier` node checks the
answer and either accepts it or sends it back once. masenvs hands `build` one ChatOpenAI
client per agent, pointed at the capture endpoint; the env scores the solver's answer.

    python examples/langgraph_math.py --model tiny --tasks-per-step 2 --branches 2 --train-steps 1
    masenvs train examples/langgraph_math.yaml          # the same program, full training
"""

from __future__ import annotations

import sys
from typing import Literal

from langchain_core.messages import HumanMessage, SystemMessage
from langgraph.graph import END, START, MessagesState, StateGraph

from masenvs.adapters.frameworks import WorkflowContext, WorkflowSpec

SOLVER = "Solve the problem step by step. End with the final answer in \\boxed{}."
VERIFIER = (
    "You check a proposed solution. If it is right, reply CORRECT. Otherwise say what is "
    "wrong in one or two sentences."
)
MAX_ATTEMPTS = 2


class State(MessagesState):
    answer: str
    attempts: int
    verdict: str


def build(ctx: WorkflowContext):
    """The factory masenvs calls for every run: clients in, compiled graph out."""
    solver, verifier = ctx.clients["solver"], ctx.clients["verifier"]

    async def solve(state: State) -> dict:
        prompt = [SystemMessage(SOLVER), *state["messages"]]
        if state.get("verdict"):
            prompt.append(HumanMessage(f"A reviewer says: {state['verdict']}\nTry again."))
        reply = await solver.ainvoke(prompt)
        return {"messages": [reply], "answer": reply.text, "attempts": state.get("attempts", 0) + 1}

    async def verify(state: State) -> dict:
        reply = await verifier.ainvoke(
            [
                SystemMessage(VERIFIER),
                HumanMessage(f"{ctx.task}\n\nProposed solution:\n{state['answer']}"),
            ]
        )
        return {"verdict": reply.text}

    def route(state: State) -> Literal["solve", "__end__"]:
        accepted = "CORRECT" in state["verdict"].upper()
        return END if accepted or state["attempts"] >= MAX_ATTEMPTS else "solve"

    graph = StateGraph(State)
    graph.add_node("solve", solve)
    graph.add_node("verify", verify)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "verify")
    graph.add_conditional_edges("verify", route)
    return graph.compile()


SPEC = WorkflowSpec(
    factory="examples.langgraph_math:build",
    framework="langgraph",
    agents=["solver", "verifier"],
    answer_from="answer",  # the solver's last answer, not the verifier's verdict
    recursion_limit=12,
)

if __name__ == "__main__":
    from masenvs.trainer.commands.workflow import main

    sys.exit(
        main(
            SPEC, "math", sys.argv[1:], factory=build, env_options={"level": 1}, description=__doc__
        )
    )
