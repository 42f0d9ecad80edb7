"""LlamaIndex programs: an `AgentWorkflow`, a single workflow agent (`FunctionAgent`,
`ReActAgent`) or any `Workflow` whose start event takes `user_msg`.

Input: `run(user_msg=text)` with the env's messages as one text. Answer: the final
`AgentOutput.response` of an agent workflow, or the stop event's result as text.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from llama_index.core.workflow import Workflow


def is_program(obj: Any) -> bool:
    return isinstance(obj, Workflow)


async def run_workflow(program: Workflow, task: str, *, answer_from: str | None = None) -> str:
    """Run `program` on `task`; its final answer as text. Cancelling stops the workflow too."""
    if answer_from is not None:
        raise ValueError(
            "answer_from is not supported for LlamaIndex: an agent workflow's answer is the "
            "response of the agent that finished; return a custom workflow instead"
        )
    handler = program.run(user_msg=task)
    try:
        result = await handler
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await handler.cancel_run()
        raise
    return answer_text(result)


def answer_text(result: Any) -> str:
    response = getattr(result, "response", None)  # AgentOutput
    if response is not None:
        content = getattr(response, "content", response)
        return "" if content is None else str(content)
    return "" if result is None else str(result)
