"""Runs scripts written against the published MetaAgent-X `workflow` API, unchanged.

The released designer writes Python such as

    from workflow import AgentNode, Workflow, ToolRegistry
    from workflow.nodes import EnsembleNode, ReflectionNode
    from utils.environments.math_env import MathEnvironment
    ...
    workflow = Workflow(name="solve")
    workflow.add_nodes([ensemble, reflection])
    result = workflow.run(question)

Inside a design's sandbox the names `workflow` and `utils.environments` are made to
resolve to this folder's packages (`install`): our own implementation of that API (written here from its
documented behaviour, no code copied). Its nodes map onto `masenvs.mas` blocks: every
`AgentNode` is a `ToolAgent` (multi-turn, Python tool run in the sandbox through the gate),
and every LLM call goes through the design's gate like any block's. The design's answer
is the final message of the last top-level `Workflow.run` / `AgentGraph.run`, or, when the
script ran none, what it printed. Nothing here is installed as a top-level module.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import sys
import types
from collections.abc import Coroutine
from typing import Any

# The published harness rewrites `workflow` / `utils` imports to this package path; a
# designer that writes it directly gets the same modules.
PUBLISHED = "pettingllms.multi_agent_env.autoevol"
_USES_API = re.compile(
    r"^[ \t]*(?:from|import)[ \t]+(?:workflow|utils\.environments|" + re.escape(PUBLISHED) + r")\b",
    re.M,
)
PRINTED_CHARS = 20_000  # what is kept of a script's printed output

_loop: asyncio.AbstractEventLoop | None = None


def uses_workflow_api(source: str) -> bool:
    """Whether a design is a script against the published `workflow` API."""
    return bool(_USES_API.search(source))


def install() -> None:
    """Make the top-level names `workflow` and `utils` (and their submodules) this folder's
    packages, for the scripts' imports; only ever called inside a design's sandbox."""
    import masenvs.mas.compat.utils.environments
    import masenvs.mas.compat.workflow  # noqa: F401

    prefix = f"{__name__}."
    parts = PUBLISHED.split(".")
    for i in range(1, len(parts) + 1):  # empty parent packages for the long import path
        name = ".".join(parts[:i])
        package = sys.modules.setdefault(name, types.ModuleType(name))
        package.__path__ = []
    for name, module in list(sys.modules.items()):
        if name.startswith((f"{prefix}workflow", f"{prefix}utils")):
            short = name[len(prefix) :]
            sys.modules[short] = sys.modules[f"{PUBLISHED}.{short}"] = module
            if "." not in short:  # `from pettingllms...autoevol import workflow`
                setattr(sys.modules[PUBLISHED], short, module)


def run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine from the API's synchronous code, on one loop kept for the whole
    script (the LLM's HTTP client stays bound to the loop it first ran on)."""
    global _loop
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coro.close()
        raise RuntimeError(
            "the workflow API is synchronous: call workflow.run(...) outside async code"
        )
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop.run_until_complete(coro)


def close() -> None:
    global _loop
    if _loop is not None and not _loop.is_closed():
        _loop.close()
    _loop = None


class _Capped(io.StringIO):
    """stdout of a script: kept up to PRINTED_CHARS, the rest counted and dropped."""

    def write(self, text: str) -> int:
        room = PRINTED_CHARS - self.tell()
        if room > 0:
            super().write(text[:room])
        return len(text)


def run_script(
    code: Any, llm: Any, task_type: str | None = None, question: str | None = None
) -> dict[str, Any]:
    """Execute a compiled workflow script with `llm` as every node's model; return
    {"answer", "graph", "error"} as a design run reports them. The task's question is also
    in the environment as WORKFLOW_QUESTION (scripts usually write it in themselves)."""
    from masenvs.mas.llm import BudgetExceeded, use

    install()
    os.environ["TASK_TYPE"] = task_type or "math"  # read by the nodes, as the original's
    os.environ["WORKFLOW_QUESTION"] = question or ""
    from workflow import core

    core.reset()
    out: dict[str, Any] = {"answer": None, "graph": None, "error": None}
    printed = _Capped()
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    if llm.harness == "published":  # the client the published harness defines first
        from masenvs.mas.compat.published import HarnessClient

        namespace["ai_client"] = HarnessClient()
    try:
        with use(llm), contextlib.redirect_stdout(printed):
            exec(code, namespace)
    except BudgetExceeded as exc:
        out["error"] = f"budget: {exc}"
    except SystemExit as exc:  # the original's scripts exit(1) after printing an error
        if exc.code not in (None, 0):
            out["error"] = f"error: the script exited with {exc.code!r}: {_tail(printed)}"
    except BaseException as exc:  # the design's own failure, reported, never raised
        out["error"] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
    finally:
        with contextlib.suppress(Exception):
            run_sync(llm.aclose())
        close()
    final = core.last_result()
    if out["error"] is None:
        if final is not None and final.message_type == core.MessageType.ERROR:
            out["error"] = f"error: the workflow failed: {str(final.content)[:300]}"
        elif final is not None:
            out["answer"] = final.content if isinstance(final.content, str) else str(final.content)
        else:
            out["answer"] = printed.getvalue()
    out["graph"] = core.design_graph(llm.calls_by_node())
    return out


def _tail(printed: io.StringIO) -> str:
    lines = printed.getvalue().strip().splitlines()
    return lines[-1][:200] if lines else "(it printed nothing)"
