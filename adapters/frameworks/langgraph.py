"""LangGraph programs: a compiled graph (`StateGraph(...).compile()`).

Input: `{"messages": env_messages}` (the `MessagesState` convention), or for a graph with
a state of its own the declared mapping `input` (`{"question": "{task}"}`: each value a
template over the task's `task`, `env`, `seed`; `"{messages}"` alone is the message list).
Answer: the state key `answer_from` if given (a string or a message), else the text of the
last AI message.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

from langchain_core.messages import AIMessage, BaseMessage
from langgraph.pregel import Pregel

from masenvs.adapters.frameworks.programs import AnswerTypeError, kind_of


def is_program(obj: Any) -> bool:
    return isinstance(obj, Pregel)


class GraphInputError(ValueError):
    """The graph's state cannot take the input masenvs passes; the message says how to map it."""


def input_keys(graph: Pregel, schema_of: str = "input_schema") -> list[str] | None:
    """The keys of the graph's input state (its TypedDict or pydantic schema; `schema_of`
    "output_schema": of its final state); None: unknown."""
    schema = getattr(getattr(graph, "builder", None), schema_of, None)
    if schema is None:
        return None
    fields = getattr(schema, "model_fields", None)
    if isinstance(fields, dict):
        return list(fields)
    try:
        return list(typing.get_type_hints(schema))
    except Exception:  # an unresolvable annotation: the schema cannot be read
        return list(getattr(schema, "__annotations__", {})) or None


def graph_input(
    messages: list[dict[str, Any]],
    mapping: dict[str, Any] | None,
    fields: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The graph's input: `{"messages": messages}`, or `mapping` with each string value
    formatted with `fields` (task, env, seed); `"{messages}"` alone is the message list."""
    if mapping is None:
        return {"messages": messages}
    values = {"messages": messages, **(fields or {})}
    out = {}
    for key, value in mapping.items():
        if value == "{messages}":
            out[key] = messages
        elif isinstance(value, str):
            try:
                out[key] = value.format_map(values)
            except (KeyError, IndexError, ValueError) as exc:
                raise GraphInputError(
                    f"workflow.input.{key}={value!r} is not a template masenvs can fill "
                    f"({type(exc).__name__}: {exc}); use {{task}}, {{env}} or {{seed}}"
                ) from None
        else:
            out[key] = value  # a constant: tries: 0
    return out


def check_input(graph: Pregel, mapping: dict[str, Any] | None) -> None:
    """Fail with one line if the graph's state cannot take what masenvs passes it."""
    keys = input_keys(graph)
    if keys is None:
        return
    passed = ["messages"] if mapping is None else list(mapping)
    missing = [k for k in passed if k not in keys]
    if missing:
        raise GraphInputError(input_hint(keys, mapping, f"has no key {missing[0]!r}"))


def check_answer_from(graph: Pregel, answer_from: str | None) -> None:
    """Fail with one line, and the closest key, if the final state has no `answer_from`."""
    keys = input_keys(graph, "output_schema")
    if answer_from is None or keys is None or answer_from in keys:
        return
    close = difflib.get_close_matches(answer_from, keys, n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    raise GraphInputError(
        f"workflow.answer_from={answer_from!r} is not a key of the graph's state; {guess}"
        f"its keys: {', '.join(keys)}"
    )


def input_hint(keys: list[str] | None, mapping: dict[str, Any] | None, what: str) -> str:
    """One line: what masenvs passed, what the graph's state holds, how to map the task."""
    passed = (
        "{'messages': <the task as chat messages>}"
        if mapping is None
        else f"{{{', '.join(f'{k!r}: ...' for k in mapping)}}} (workflow.input)"
    )
    state = f" (keys: {', '.join(keys)})" if keys else ""
    first = next((k for k in keys or [] if k != "messages"), "question")
    return (
        f"the graph's input state{state} {what}: masenvs passed {passed}; map the task to "
        f"the graph's own keys in the config, e.g. workflow.input: {{{first}: '{{task}}'}} "
        "and workflow.answer_from: <the state key holding the answer>"
    )


async def run_graph(
    graph: Pregel,
    messages: list[dict[str, Any]],
    *,
    answer_from: str | None = None,
    recursion_limit: int = 25,
    input_map: dict[str, Any] | None = None,
    fields: dict[str, Any] | None = None,
) -> str:
    """Run `graph` on the env's task; its final answer as text."""
    check_input(graph, input_map)
    payload = graph_input(messages, input_map, fields)
    try:
        state = await graph.ainvoke(payload, config={"recursion_limit": recursion_limit})
    except KeyError as exc:
        # A node reading a state key the input never set: say what was passed, and how to map.
        if input_map is None and exc.args and exc.args[0] != "messages":
            keys = input_keys(graph)
            raise GraphInputError(
                input_hint(keys, None, f"lacked {exc.args[0]!r} (KeyError in a node)")
            ) from exc
        raise
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
