"""AutoGen AgentChat programs: a team (`RoundRobinGroupChat`, `SelectorGroupChat`, ...) or
a single agent (`AssistantAgent`).

Input: `run(task=text)` with the env's messages as one text. Answer: the last chat message
of agent `answer_from` if given, else the last chat message of any agent.
"""

from __future__ import annotations

import asyncio
import difflib
from typing import Any

from autogen_agentchat.base import ChatAgent, TaskResult, Team
from autogen_agentchat.messages import BaseChatMessage
from autogen_core import CancellationToken


def is_program(obj: Any) -> bool:
    return isinstance(obj, (Team, ChatAgent))


async def run_team(program: Team | ChatAgent, task: str, *, answer_from: str | None = None) -> str:
    """Run `program` on `task`; its final answer as text. Cancelling stops the team too."""
    token = CancellationToken()
    try:
        result = await program.run(task=task, cancellation_token=token, output_task_messages=False)
    except asyncio.CancelledError:
        token.cancel()  # stops the team's in-flight model calls and agent loops
        raise
    return answer_text(result, answer_from)


def answer_text(result: TaskResult, answer_from: str | None = None) -> str:
    """The last chat message (of `answer_from`, if given) in a team's result."""
    for message in reversed(result.messages):
        if not isinstance(message, BaseChatMessage) or message.source == "user":
            continue
        if answer_from is None or message.source == answer_from:
            return message.to_text()
    if answer_from is not None:
        sources = sorted({m.source for m in result.messages if isinstance(m, BaseChatMessage)})
        raise LookupError(
            f"no message from answer_from={answer_from!r} in the team's result "
            f"(speakers: {', '.join(sources) or 'none'})"
        )
    return ""


def check_answer_from(program: Team | ChatAgent, answer_from: str | None) -> None:
    """Fail with one line, and the closest name, if no agent of the team is `answer_from`."""
    agents = getattr(program, "_participants", None) or [program]  # a team's, or the agent
    names = [name for name in (getattr(a, "name", None) for a in agents) if isinstance(name, str)]
    if answer_from is None or not names or answer_from in names:
        return
    close = difflib.get_close_matches(answer_from, names, n=1)
    guess = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(
        f"workflow.answer_from={answer_from!r} is not an agent of the team; {guess}"
        f"its agents: {', '.join(names)}"
    )
