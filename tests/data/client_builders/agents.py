"""Existing agents whose builders take their LLM clients, as users write them: no masenvs
import, no WorkflowContext. masenvs passes each parameter its agent's framework client."""

from typing import TypedDict


def make_graph(solver_llm, checker_llm):
    """LangGraph: solve -> check -> solve -> check, the answer kept in the state key `answer`."""
    from langgraph.graph import END, START, StateGraph

    class Solve(TypedDict):
        question: str
        answer: str
        verdict: str
        tries: int

    async def solve(state: Solve) -> dict:
        reply = await solver_llm.ainvoke(f"Solve: {state['question']}")
        return {"answer": reply.text, "tries": state.get("tries", 0) + 1}

    def check(state: Solve) -> dict:
        return {"verdict": checker_llm.invoke(f"Check: {state['answer']}").text}

    graph = StateGraph(Solve)
    graph.add_node("solve", solve)
    graph.add_node("check", check)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", "check")
    graph.add_conditional_edges("check", lambda s: END if s["tries"] >= 2 else "solve")
    return graph.compile()


def make_team(model_client):
    """AutoGen: one assistant built from a `model_client`, two turns."""
    from autogen_agentchat.agents import AssistantAgent
    from autogen_agentchat.conditions import MaxMessageTermination
    from autogen_agentchat.teams import RoundRobinGroupChat

    solver = AssistantAgent("solver", model_client=model_client)
    return RoundRobinGroupChat([solver], termination_condition=MaxMessageTermination(3))


def make_workflow(llm):
    """LlamaIndex: a workflow of one step built from an `llm`, two calls."""
    from llama_index.core.llms import ChatMessage
    from llama_index.core.workflow import StartEvent, StopEvent, Workflow, step

    class Solve(Workflow):
        @step
        async def solve(self, ev: StartEvent) -> StopEvent:
            draft = await llm.achat([ChatMessage(role="user", content=ev.user_msg)])
            again = f"Improve: {draft.message.content or ''}"
            reply = await llm.achat([ChatMessage(role="user", content=again)])
            return StopEvent(result=reply.message.content or "")

    return Solve(timeout=None)


def make_oracle():
    """LangGraph, no model call: the task's own answer, bare, in the state key `answer`."""
    from langgraph.graph import END, START, StateGraph

    from masenvs.registry import make

    class Solve(TypedDict):
        question: str
        seed: str
        answer: str

    def solve(state: Solve) -> dict:
        env = make("math", level=1, single_agent=True, max_rounds=1)
        env.reset(seed=int(state["seed"]))
        return {"answer": env.task.answer}

    graph = StateGraph(Solve)
    graph.add_node("solve", solve)
    graph.add_edge(START, "solve")
    graph.add_edge("solve", END)
    return graph.compile()
