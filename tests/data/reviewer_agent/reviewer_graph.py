"""An existing LangGraph agent: a state of its own (not messages), sync nodes, ChatOpenAI
clients. masenvs trains it through `workflow.input` and `workflow.answer_from`."""

from typing import TypedDict

from langgraph.graph import END, START, StateGraph


class Review(TypedDict):
    question: str
    draft: str
    verdict: str
    tries: int


def build(writer, critic):
    def write(state: Review) -> dict:
        reply = writer.invoke(f"Answer: {state['question']}")
        return {"draft": reply.text, "tries": state.get("tries", 0) + 1}

    def review(state: Review) -> dict:
        reply = critic.invoke(f"Is this right? {state['draft']}")
        return {"verdict": reply.text}

    graph = StateGraph(Review)
    graph.add_node("write", write)
    graph.add_node("review", review)
    graph.add_edge(START, "write")
    graph.add_edge("write", "review")
    graph.add_conditional_edges("review", lambda s: END if s["tries"] >= 2 else "write")
    return graph.compile()
