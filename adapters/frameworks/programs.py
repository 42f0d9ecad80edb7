"""Run a framework program on an env's chat messages and return its final answer as text.

A program is what a user's factory returns: a compiled LangGraph graph, an AutoGen team or
agent, a LlamaIndex workflow, or, for anything else, an async function
`(messages: list[dict]) -> str`. Role mode and workflow mode both run programs this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from masenvs.adapters.frameworks.clients import FRAMEWORKS, Framework
from masenvs.env import messages_to_text

Messages = list[dict[str, Any]]
AsyncProgram = Callable[[Messages], Awaitable[str]]
T = TypeVar("T")


class ProgramTimeout(TimeoutError):
    """The program ran past its time limit."""


class AnswerTypeError(TypeError):
    """The program's final answer is not text; the run fails instead of scoring `str(x)`."""


def kind_of(value: Any) -> str:
    """`a list`, `None`, `a dict`: how an error names a value's type."""
    if value is None:
        return "None"
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


@dataclass
class RunLimits:
    """How a program runs: where its answer is, and when it is stopped."""

    answer_from: str | None = None  # LangGraph: state key; AutoGen: agent name
    recursion_limit: int = 25  # LangGraph super-steps before GraphRecursionError
    timeout_s: float | None = 600.0  # wall seconds for one run; None: no limit
    input: dict[str, Any] | None = None  # LangGraph: state key -> template ({task}); None: messages
    input_fields: dict[str, Any] = field(default_factory=dict)  # what the templates fill in


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
        raise AnswerTypeError(
            f"the program returned {kind_of(answer)}, not text: an async function program "
            "(messages) -> str must return its final answer as a str"
        )
    return answer


log = logging.getLogger("masenvs.frameworks")
_warned_empty: set[tuple[Any, ...]] = set()


def warn_if_empty(
    answer: str, kind: tuple[Any, ...], framework: Framework, answer_from: str | None, where: str
) -> None:
    """Warn once per kind of run (one workflow, one role) that its final answer is empty,
    and say where masenvs looked for it: an empty answer is scored, silently, as no answer."""
    if answer.strip() or kind in _warned_empty:
        return
    _warned_empty.add(kind)
    if framework == "llamaindex":
        hint = "end the workflow with StopEvent(result=answer_text) (answer_from does not apply)"
    elif answer_from is not None:
        owner = "state key" if framework == "langgraph" else "agent"
        hint = f"answer_from={answer_from!r} gave empty text: check that {owner}"
    elif framework == "langgraph":
        hint = (
            "masenvs read the last AI message; if the graph keeps its answer in a state "
            "key, set answer_from to that key"
        )
    else:
        hint = (
            "masenvs read the last agent message; set answer_from to the agent that gives "
            "the answer"
        )
    log.warning(
        "%s: the program's final answer is empty, scored as no answer; %s "
        "(an async function program must return the answer). Warned once for this program.",
        where,
        hint,
    )


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
            input_map=limits.input,
            fields={"task": messages_to_text(messages), **limits.input_fields},
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


# -- isolation: every run in its own thread with its own event loop ---------------------------

# Frameworks whose own warnings (multi-line tracebacks) are kept in the run's record instead
# of the log: masenvs logs each failed run once, in one line.
CAPTURED_LOGGERS = ("autogen_core", "autogen_agentchat", "autogen_ext")
_sinks: dict[int, list[str]] = {}  # thread id -> the log lines of the run on that thread
_abandoned: set[threading.Thread] = set()  # threads of programs stopped at their deadline


def settle_abandoned(timeout_s: float = 5.0) -> bool:
    """Wait up to `timeout_s` for the threads of programs stopped at their deadline to end
    (each was cancelled then, and ends at its next `await`); whether all have.

    A process should not exit with one still running: at exit CPython stops a daemon thread
    by unwinding it, which aborts the whole process ("FATAL: exception not rethrown", status
    -6) when the unwinding crosses a C++ frame."""
    deadline = time.monotonic() + timeout_s
    for thread in list(_abandoned):
        thread.join(max(0.0, deadline - time.monotonic()))
        if not thread.is_alive():
            _abandoned.discard(thread)
    return not _abandoned


class _RunLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        sink = _sinks.get(threading.get_ident())
        if sink is None or record.levelno < logging.WARNING:
            return True
        text = f"{record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        sink.append(text)
        return False


_filter = _RunLogs()


def _capture_framework_logs() -> None:
    for name in CAPTURED_LOGGERS:
        logger = logging.getLogger(name)
        if _filter not in logger.filters:
            logger.addFilter(_filter)


@dataclass
class Isolation:
    """What a program run in its own thread leaves behind: its captured framework logs, and
    the callbacks that cut it off when it runs past its deadline."""

    name: str
    logs: list[str] = field(default_factory=list)
    on_timeout: list[Callable[[], None]] = field(default_factory=list)


async def run_isolated(
    body: Callable[[Isolation], Awaitable[T]], timeout_s: float | None, isolation: Isolation
) -> T:
    """Run `body` in a thread of its own with its own event loop, within `timeout_s`.

    A blocking call in the program (`time.sleep` in an async node) stalls only its own
    thread: the caller's loop, the other runs and the trainer go on, and the deadline is
    kept. A thread cannot be killed: at the deadline its task is cancelled (effective at its
    next `await`) and `on_timeout` callbacks run (they revoke the run's clients, so its late
    calls are refused); the thread ends whenever its blocking call returns. Raises what
    `body` raised, or `ProgramTimeout`.
    """
    _capture_framework_logs()
    caller = asyncio.get_running_loop()
    done: asyncio.Future[T] = caller.create_future()
    lock = threading.Lock()
    inner: dict[str, Any] = {}  # the thread's loop and task, once running
    abandoned = False

    def deliver(result: Any, error: BaseException | None) -> None:
        if abandoned or done.done():
            return
        if isinstance(error, asyncio.CancelledError):
            done.cancel()
        elif error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    async def main() -> T:
        with lock:
            inner["loop"], inner["task"] = asyncio.get_running_loop(), asyncio.current_task()
            cancelled = inner.get("cancelled", False)
        if cancelled:
            raise asyncio.CancelledError
        return await body(isolation)

    def target() -> None:
        _sinks[threading.get_ident()] = isolation.logs
        result, error = None, None
        try:
            result = asyncio.run(main())
        except BaseException as exc:  # delivered to the caller, who decides
            error = exc
        finally:
            _sinks.pop(threading.get_ident(), None)
        with contextlib.suppress(RuntimeError):  # the caller's loop has closed meanwhile
            caller.call_soon_threadsafe(deliver, result, error)

    def cancel() -> None:
        with lock:
            inner["cancelled"] = True
            loop, task = inner.get("loop"), inner.get("task")
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # its loop has just finished
                loop.call_soon_threadsafe(task.cancel)

    thread = threading.Thread(target=target, name=isolation.name, daemon=True)
    thread.start()
    try:
        result = await asyncio.wait_for(asyncio.shield(done), timeout_s)
    except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
        abandoned = True
        _abandoned.add(thread)
        cancel()
        for callback in isolation.on_timeout:
            callback()
        if isinstance(exc, asyncio.CancelledError):
            raise
        raise ProgramTimeout(f"the program ran past timeout_s={timeout_s:g}") from None
    return result


def error_detail(exc: BaseException, isolation: Isolation | None = None) -> str:
    """The full story of a failed run for its record: the traceback and framework logs."""
    parts = ["".join(traceback.format_exception(exc)).rstrip()]
    if isolation is not None and isolation.logs:
        parts += ["framework logs of this run:", *isolation.logs]
    return "\n".join(parts)
