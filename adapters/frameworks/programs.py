"""Run a framework program on an env's chat messages and return its final answer as text.

A program is what a user's factory returns: a compiled LangGraph graph, an AutoGen team or
agent, a LlamaIndex workflow, or, for anything else, an async function
`(messages: list[dict]) -> str`. Role mode and workflow mode both run programs this way.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from masenvs.adapters.frameworks.clients import FRAMEWORKS, Framework
from masenvs.env import messages_to_text

Messages = list[dict[str, Any]]
AsyncProgram = Callable[[Messages], Awaitable[str]]


class ProgramTimeout(TimeoutError):
    """The program ran past its time limit."""


@dataclass
class RunLimits:
    """How a program runs: where its answer is, and when it is stopped."""

    answer_from: str | None = None  # LangGraph: state key; AutoGen: agent name
    recursion_limit: int = 25  # LangGraph super-steps before GraphRecursionError
    timeout_s: float | None = 600.0  # wall seconds for one run; None: no limit


def check_program(framework: Framework, program: Any) -> None:
    """Fail with one sentence if `program` is not something `framework` can run."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; use one of {', '.join(FRAMEWORKS)}")
    if not _module(framework).is_program(program) and not _is_async_program(program):
        expected = {
            "langgraph": "a compiled graph (StateGraph(...).compile())",
            "autogen": "an AutoGen team (RoundRobinGroupChat, SelectorGroupChat, ...) or agent",
            "llamaindex": "a LlamaIndex Workflow (AgentWorkflow, FunctionAgent, ...)",
        }[framework]
        raise TypeError(
            f"framework {framework!r} expects {expected} or an async function "
            f"(messages) -> str, but the factory returned {type(program).__module__}."
            f"{type(program).__qualname__}"
        )


async def run_program(
    framework: Framework, program: Any, messages: Messages, limits: RunLimits | None = None
) -> str:
    """Run `program` on `messages` within `limits.timeout_s`; its final answer as text."""
    limits = limits or RunLimits()
    check_program(framework, program)
    run = _start(framework, program, messages, limits)
    if limits.timeout_s is None:
        answer = await run
    else:
        try:
            answer = await asyncio.wait_for(run, limits.timeout_s)
        except asyncio.TimeoutError:
            raise ProgramTimeout(f"the program ran past timeout_s={limits.timeout_s:g}") from None
    if not isinstance(answer, str):
        answer = "" if answer is None else str(answer)
    return answer


def failure_reason(exc: BaseException, limit: int = 500) -> str:
    """One line naming the exception and its message (frameworks append whole tracebacks)."""
    lines = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def _start(framework: Framework, program: Any, messages: Messages, limits: RunLimits) -> Any:
    if not _module(framework).is_program(program):
        return program(messages)  # the async-function escape hatch
    if framework == "langgraph":
        from masenvs.adapters.frameworks.langgraph import run_graph

        return run_graph(
            program,
            messages,
            answer_from=limits.answer_from,
            recursion_limit=limits.recursion_limit,
        )
    if framework == "autogen":
        from masenvs.adapters.frameworks.autogen import run_team

        return run_team(program, messages_to_text(messages), answer_from=limits.answer_from)
    from masenvs.adapters.frameworks.llamaindex import run_workflow

    return run_workflow(program, messages_to_text(messages), answer_from=limits.answer_from)


def _is_async_program(program: Any) -> bool:
    # A function, or an object whose __call__ is async.
    return inspect.iscoroutinefunction(program) or (
        callable(program) and inspect.iscoroutinefunction(type(program).__call__)
    )


def _module(framework: Framework) -> Any:
    # Imported on use: each framework is heavy and optional.
    if framework == "langgraph":
        from masenvs.adapters.frameworks import langgraph as module
    elif framework == "autogen":
        from masenvs.adapters.frameworks import autogen as module
    else:
        from masenvs.adapters.frameworks import llamaindex as module
    return module
