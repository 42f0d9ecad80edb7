"""LlamaIndex programs: an `AgentWorkflow`, a single workflow agent (`FunctionAgent`,
`ReActAgent`) or any `Workflow` whose start event takes `user_msg`.

Input: `run(user_msg=text)` with the env's messages as one text. Answer: the final
`AgentOutput.response` of an agent workflow, or the stop event's result as text.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from llama_index.core.agent.workflow import AgentOutput
from llama_index.core.llms import ChatMessage, ChatResponse
from llama_index.core.workflow import Workflow

from masenvs.adapters.frameworks.programs import AnswerTypeError, kind_of


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
    """An agent workflow's final response, or the text a custom workflow stopped with."""
    if isinstance(result, AgentOutput):
        return result.response.content or ""
    if isinstance(result, str):
        return result
    if isinstance(result, ChatMessage):
        return result.content or ""
    if isinstance(result, ChatResponse):
        return result.message.content or ""
    raise AnswerTypeError(
        f"the workflow stopped with {kind_of(result)}, not the answer's text; end it with "
        "StopEvent(result=answer) where answer is a str"
    )
