"""LangGraph programs: a compiled graph (`StateGraph(...).compile()`) over a messages state.

Input: `{"messages": env_messages}` (the `MessagesState` convention). Answer: the state key
`answer_from` if given (a string or a message), else the text of the last AI message.
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langgraph.pregel import Pregel

from masenvs.adapters.frameworks.programs import AnswerTypeError, kind_of


def is_program(obj: Any) -> bool:
    return isinstance(obj, Pregel)


async def run_graph(
    graph: Pregel,
    messages: list[dict[str, Any]],
    *,
    answer_from: str | None = None,
    recursion_limit: int = 25,
) -> str:
    """Run `graph` on the env's messages; its final answer as text."""
    state = await graph.ainvoke({"messages": messages}, config={"recursion_limit": recursion_limit})
    return answer_text(state, answer_from)


def answer_text(state: Any, answer_from: str | None = None) -> str:
    """The answer in a graph's final state (see the module docstring)."""
    if not isinstance(state, dict):
        return _text(state)
    if answer_from is not None:
        if answer_from not in state:
            raise KeyError(
                f"answer_from={answer_from!r} is not a key of the graph's final state "
                f"(keys: {', '.join(map(str, state))})"
            )
        value = state[answer_from]
        if isinstance(value, list) and value and isinstance(value[-1], BaseMessage):
            value = value[-1]
        return _text(value, f"state key answer_from={answer_from!r}")
    messages = state.get("messages")
    if not isinstance(messages, list):
        raise KeyError(
            "the graph's final state has no 'messages' list; set answer_from to the state key "
            "that holds the answer"
        )
    for message in reversed(messages):
        if isinstance(message, AIMessage):
            return _text(message)
    return ""


def _text(value: Any, where: str = "the graph's final state") -> str:
    """Text, a message (or a list ending in one) or a number; anything else (a list, a dict,
    None) fails the run instead of being `str()`-ed and scored."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, BaseMessage):
        return str(value.text)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise AnswerTypeError(
        f"{where} holds {kind_of(value)}, not the answer's text (a str, a message or a number); "
        "store the final answer as text"
    )
