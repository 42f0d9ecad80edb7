"""AgentNode: one agent that works in turns with its tools (a masenvs `ToolAgent`).

Like the original, it sees the run's original question plus what earlier agents shared
(their `<delivery>` block, else a cut of their reply), its system prompt gets a delivery
instruction for the task type, and every ```python block it writes is run (through the
registry's `python_execute` when the design registered its own, else the sandbox).
"""

from __future__ import annotations

import json
import os
from typing import Any

from masenvs.mas.blocks import ToolAgent

from ..core import Context, Message, MessageType, ToolRegistry, WorkflowNode, agent_created, as_text

DELIVERY_MATH = (
    "\n\nWhen you are done, output two things:\n"
    "1. The key steps the next agent should know, inside <delivery>...</delivery>.\n"
    "2. Your final answer as: FINAL ANSWER: \\boxed{your_answer}"
)
DELIVERY_CODE = (
    "\n\nWhen you are done, output two things:\n"
    "1. The key steps the next agent should know, inside <delivery>...</delivery>.\n"
    "2. Your complete program inside <solution>...</solution>, nothing else in those tags."
)
PYTHON_NOTE = (
    "\n\nTo run Python, write it in a ```python block: it runs in a fresh process (include "
    "every import) and you are shown its output."
)
SHARED_CHARS = 1200  # how much of an earlier agent's reply without <delivery> is shared


def delivery_instruction() -> str:
    return DELIVERY_CODE if os.environ.get("TASK_TYPE", "math").lower() == "code" else DELIVERY_MATH


def delivery(text: str) -> str | None:
    """What an agent chose to share: its `<delivery>` block, else its final-answer line,
    else its `<solution>` block."""
    start = text.find("<delivery>")
    end = text.find("</delivery>", start)
    if start >= 0 and end > start:
        return text[start + len("<delivery>") : end].strip()
    at = text.upper().rfind("FINAL ANSWER:")
    if at >= 0:
        return text[at + len("FINAL ANSWER:") :].strip()
    start = text.find("<solution>")
    end = text.find("</solution>", start)
    if start >= 0 and end > start:
        return text[start : end + len("</solution>")].strip()
    return None


def shared(text: str) -> str:
    """An earlier agent's reply as the next agent sees it."""
    found = delivery(text)
    if found is not None:
        return found
    if len(text) <= SHARED_CHARS:
        return text
    return f"{text[:200]}\n...(reasoning omitted)...\n{text[-(SHARED_CHARS - 400) :]}"


class AgentNode(WorkflowNode):
    """An LLM agent with tools; `max_turns` bounds its tool runs."""

    def __init__(
        self,
        name: str,
        system_prompt: str = "",
        tool_registry: ToolRegistry | None = None,
        ai_client: Any = None,
        max_turns: int = 10,
        enable_conversation_logging: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(name, **kwargs)
        if not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"AgentNode max_turns must be an integer >= 1, got {max_turns!r}")
        self.system_prompt = system_prompt or ""
        self.tool_registry = tool_registry or ToolRegistry()
        self.ai_client = ai_client  # kept for the API; calls go to the design's executor
        self.max_turns = max_turns
        self.enable_conversation_logging = enable_conversation_logging
        agent_created(name, self.system_prompt)

    def block(self) -> ToolAgent:
        """This node as a masenvs block: a ToolAgent with the registry's tools."""
        tools: dict[str, Any] = {}
        for name in self.tool_registry.list_tools():
            func = self.tool_registry.get_tool(name)["function"]
            if getattr(func, "masenvs_sandboxed_python", False):
                continue  # our MathEnvironment: the ToolAgent's own Python tool is the same
            tools[name] = func
        if "python_execute" in tools:  # ```python blocks go to the design's own executor
            tools.setdefault("python", tools["python_execute"])
        return ToolAgent(self.name, self.system(), max_turns=self.max_turns, tools=tools)

    def system(self) -> str:
        text = self.system_prompt + PYTHON_NOTE
        others = [n for n in self.tool_registry.list_tools() if n != "python_execute"]
        if others:
            schemas = [
                s for s in self.tool_registry.get_tool_schemas() if s["function"]["name"] in others
            ]
            text += (
                f"\n\nYou also have these tools: {json.dumps(schemas)}\nCall one as "
                '<tool_call>{"name": "tool_name", "arguments": {...}}</tool_call>.'
            )
        return text + delivery_instruction()

    def messages(self, context: Context) -> list[dict[str, str]]:
        """The original question, then what each earlier agent of this run shared."""
        question = context.question()
        earlier = context.get_messages_by_type(MessageType.AGENT_RESPONSE)
        if not earlier:
            return [{"role": "user", "content": question}]
        parts = [f"**Original Question:**\n{question}\n", "**Previous Agents' Analysis:**\n"]
        parts += [f"[{m.sender or 'Agent'}]:\n{shared(as_text(m.content))}\n" for m in earlier]
        parts.append(
            "Based on the original question and the analysis above, give your own solution."
        )
        return [{"role": "user", "content": "\n".join(parts)}]

    def process(self, context: Context) -> Message:
        from masenvs.mas.compat import run_sync
        from masenvs.mas.llm import current

        from ..core import agent_ran

        llm = current()
        if llm.harness == "published":
            return self.process_published(context, llm)
        agent_ran(self.name)
        reply = run_sync(self.block().run(self.messages(context)))
        return Message(reply, MessageType.AGENT_RESPONSE, {"agent_name": self.name})

    def process_published(self, context: Context, llm: Any) -> Message:
        """As the published harness runs a node (masenvs.mas.compat.published): the client of
        the workflow in the context, its prompts, its loop."""
        from masenvs.mas.compat import published, run_sync

        from ..core import agent_ran

        # agent_node.py:547-548: no workflow in the context (an AgentGraph, a Conditional- or
        # LoopWorkflow) fails here; a Workflow the harness gave no client, at its first call.
        client = context.state.get("workflow").ai_client
        if client is None:
            raise AttributeError("'NoneType' object has no attribute 'chat'")
        agent_ran(self.name)
        earlier = [
            (m.sender or "Agent", as_text(m.content))
            for m in context.get_messages_by_type(MessageType.AGENT_RESPONSE)
        ]
        messages = [
            {"role": "system", "content": published.system_prompt(self.system_prompt)},
            {"role": "user", "content": published.user_turn(context.question(), earlier)},
        ]
        loop = published.agent_loop(self.name, messages, self.tool_registry, self.max_turns, llm)
        return Message(run_sync(loop), MessageType.AGENT_RESPONSE, {"agent_name": self.name})
