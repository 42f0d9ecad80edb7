"""DebateNode: debaters answer, then revise after reading each other; a judge decides."""

from __future__ import annotations

from typing import Any

from masenvs.mas.compat import published
from masenvs.mas.llm import current_harness

from ..core import Context, Message, MessageType, WorkflowNode, as_text
from .agent_node import shared


class DebateNode(WorkflowNode):
    """`num_rounds` rounds; from the second on, each debater sees the earlier rounds. The
    judge (default: the first debater) reads the last round and gives the answer."""

    def __init__(
        self,
        name: str,
        debaters: list[WorkflowNode],
        judge: WorkflowNode | None = None,
        num_rounds: int = 2,
        **kwargs: Any,
    ) -> None:
        super().__init__(name, **kwargs)
        if not debaters or not all(isinstance(d, WorkflowNode) for d in debaters):
            raise ValueError("DebateNode needs a non-empty list of nodes as debaters")
        if not isinstance(num_rounds, int) or num_rounds < 1:
            raise ValueError(f"DebateNode num_rounds must be an integer >= 1, got {num_rounds!r}")
        self.debaters, self.judge, self.num_rounds = (
            list(debaters),
            judge or debaters[0],
            num_rounds,
        )

    def process(self, context: Context) -> Message:
        question = context.question()
        mine = current_harness() != "published"
        if not mine:  # theirs debates the latest message (debate_node.py:80)
            latest = context.get_latest_message()
            question = as_text(latest.content) if latest is not None else question
        names = [d.name for d in self.debaters]
        history: list[list[str]] = []
        for round_ in range(self.num_rounds):
            replies = []
            for debater in self.debaters:
                if round_ == 0:
                    prompt = question
                elif mine:
                    prompt = self._revise(question, history)
                else:
                    prompt = published.debate_round(question, names, history)
                result = debater(
                    Context([Message(prompt, MessageType.USER_INPUT)], dict(context.state))
                )
                text = as_text(result.content)
                replies.append(
                    f"[Error: {text}]" if result.message_type == MessageType.ERROR else text
                )
            history.append(replies)
        finals = "\n\n".join(
            f"Response {i + 1} from {d.name}:\n{shared(r)}"
            for i, (d, r) in enumerate(zip(self.debaters, history[-1]))
        )
        prompt = (
            f"Original question: {question}\n\nAfter {self.num_rounds} rounds of debate, here "
            f"are the final responses:\n\n{finals}\n\nSelect the best response or give a better "
            "answer based on the debate. Provide your final answer."
            if mine
            else published.debate_judge(question, self.num_rounds, names, history[-1])
        )
        verdict = self.judge(
            Context([Message(prompt, MessageType.USER_INPUT)], dict(context.state))
        )
        return Message(
            verdict.content,
            MessageType.AGENT_RESPONSE,
            {
                "num_rounds": self.num_rounds,
                "num_debaters": len(self.debaters),
                "debate_history": history,
            },
        )

    def _revise(self, question: str, history: list[list[str]]) -> str:
        lines = ["Previous debate rounds:\n"]
        for i, replies in enumerate(history):
            lines.append(f"=== Round {i + 1} ===")
            lines += [
                f"Agent {j + 1} ({d.name}):\n{shared(r)}\n"
                for j, (d, r) in enumerate(zip(self.debaters, replies))
            ]
        history_text = "\n".join(lines)
        return (
            f"Original question: {question}\n\n{history_text}\nBased on the discussion above, give "
            "your refined answer. You may critique the other responses and improve your own."
        )

    def describe(self) -> str:
        inner = ", ".join(d.describe() for d in self.debaters)
        return f"DebateNode({inner}, rounds={self.num_rounds}, judge={self.judge.describe()})"
