"""EnsembleNode: several agents answer the same context; a vote, or a judge, decides."""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any

from masenvs.mas.blocks import answer_of
from masenvs.mas.compat import published
from masenvs.mas.llm import current_harness

from ..core import Context, Message, MessageType, WorkflowNode, as_text
from .agent_node import shared

STRATEGIES = ("majority_vote", "weighted_vote", "consensus")


def is_code_task() -> bool:
    return os.environ.get("TASK_TYPE", "math").lower() == "code"


def vote_key(text: str) -> str | None:
    """What a reply votes for: its boxed answer (math) or its <solution> code (code), in a
    normal form so that `\\dfrac{1}{2}` and `\\frac{1}{2}`, `42` and `42.0` agree."""
    if is_code_task():
        start, end = text.rfind("<solution>"), text.rfind("</solution>")
        if start < 0 or end < start:
            return None
        code = text[start + len("<solution>") : end]
        return "\n".join(line.rstrip() for line in code.strip().splitlines() if line.strip())
    answer = answer_of(text)
    if answer is None:
        return None
    key = re.sub(r"\s+", "", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    key = re.sub(r"\\text\{([^}]*)\}", r"\1", key).rstrip(".").lower()
    return re.sub(r"^(-?\d+)\.0+$", r"\1", key)


class EnsembleNode(WorkflowNode):
    """`agents` answer independently (each on a copy of the context). `majority_vote`: the
    most common answer; with a `consensus_agent`, a split vote goes to it. `weighted_vote`:
    answers weighed by `weights`. `consensus`: the consensus agent always decides."""

    def __init__(
        self,
        name: str,
        agents: list[WorkflowNode],
        strategy: str = "majority_vote",
        consensus_agent: WorkflowNode | None = None,
        weights: list[float] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name, **kwargs)
        if not agents or not all(isinstance(a, WorkflowNode) for a in agents):
            raise ValueError("EnsembleNode needs a non-empty list of nodes as agents")
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown ensemble strategy {strategy!r}; one of {STRATEGIES}")
        if strategy == "consensus" and consensus_agent is None:
            raise ValueError("the consensus strategy needs a consensus_agent")
        self.agents, self.strategy, self.consensus_agent = list(agents), strategy, consensus_agent
        self.weights = list(weights) if weights is not None else [1.0] * len(self.agents)
        if len(self.weights) != len(self.agents):
            raise ValueError("EnsembleNode needs one weight per agent")

    def process(self, context: Context) -> Message:
        answers: list[tuple[str, float, str]] = []  # (reply, weight, agent name)
        for agent, weight in zip(self.agents, self.weights):
            own = Context(list(context.messages), dict(context.state))
            result = agent(own)
            if result.message_type != MessageType.ERROR:
                answers.append((as_text(result.content), weight, agent.name))
        if not answers:
            return Message({"error": "All agents failed"}, MessageType.ERROR)
        if self.strategy == "consensus":
            final = self.consensus(context, answers)
        else:
            final = self.vote(context, answers, weighted=self.strategy == "weighted_vote")
        return Message(
            final,
            MessageType.AGENT_RESPONSE,
            {
                "strategy": self.strategy,
                "num_agents": len(self.agents),
                "all_responses": [a for a, _, _ in answers],
            },
        )

    def vote(self, context: Context, answers: list[tuple[str, float, str]], weighted: bool) -> str:
        tally: Counter[str] = Counter()
        first: dict[str, str] = {}
        for reply, weight, _ in answers:
            key = vote_key(reply)
            if key is not None:
                tally[key] += weight if weighted else 1.0
                first.setdefault(key, reply)
        if not tally:
            return answers[0][0]
        if len(tally) > 1 and self.consensus_agent is not None and not weighted:
            return self.consensus(context, answers)
        return first[tally.most_common(1)[0][0]]

    def consensus(self, context: Context, answers: list[tuple[str, float, str]]) -> str:
        if current_harness() == "published":  # its words (ensemble_node.py:313-341)
            named = [(name, reply) for reply, _, name in answers]
            prompt = published.consensus_prompt(context.question(), named)
            judge = Context([Message(prompt, MessageType.USER_INPUT)], dict(context.state))
            assert self.consensus_agent is not None
            return as_text(self.consensus_agent(judge).content)
        listing = "\n\n".join(
            f"--- Solution {i + 1} ({name}) ---\n{shared(reply)}"
            for i, (reply, _, name) in enumerate(answers)
        )
        form = (
            "Put the complete program in <solution>...</solution>."
            if is_code_task()
            else "Give the final answer in \\boxed{}."
        )
        prompt = (
            f"**Original Question:**\n{context.question()}\n\n**Multiple Solutions:**\n\n"
            f"{listing}\n\nReview each solution, check the reasoning and the calculations, "
            f"and select the best answer or give a corrected one. {form}"
        )
        judge = Context([Message(prompt, MessageType.USER_INPUT)], dict(context.state))
        assert self.consensus_agent is not None
        return as_text(self.consensus_agent(judge).content)

    def describe(self) -> str:
        inner = ", ".join(a.describe() for a in self.agents)
        judge = f", judge={self.consensus_agent.describe()}" if self.consensus_agent else ""
        return f"EnsembleNode({inner}{judge})"
