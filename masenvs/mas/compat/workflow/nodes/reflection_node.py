"""ReflectionNode: an agent answers, a critic (or the agent itself) reviews, it revises."""

from __future__ import annotations

from difflib import SequenceMatcher
from typing import Any

from masenvs.mas.compat import published as theirs
from masenvs.mas.llm import current_harness

from ..core import Context, Message, MessageType, WorkflowNode, as_text

REFLECTION = (
    "You are a critical reviewer. Analyze this response to a question.\n\n"
    "Original question: {question}\n\nResponse to review:\n{response}\n\n"
    "Point out errors and logical flaws, check that it answers every part of the question, "
    "and suggest specific improvements. If it is right, end with: VERDICT: CORRECT"
)
REFINEMENT = (
    "Original question: {question}\n\nYour previous response:\n{response}\n\n"
    "Critique from a reviewer:\n{reflection}\n\n"
    "Give an improved response that addresses every issue raised."
)
REFINEMENT_WITH_HISTORY = (
    "Original question: {question}\n\n=== Earlier iterations ===\n{history}\n\n"
    "Your latest response:\n{response}\n\nLatest critique:\n{reflection}\n\n"
    "Based on all the feedback so far, give an improved response."
)
REPEATED = 0.75  # a revision this similar to the last one ends the loop


def approved(critique: str) -> bool:
    upper = critique.upper()
    return "VERDICT: CORRECT" in upper or upper.strip().endswith("CORRECT")


class ReflectionNode(WorkflowNode):
    """`agent` answers the original question; for `num_iterations` rounds the critic reviews
    and the agent revises, stopping early when the critic says the answer is correct or
    the agent repeats itself."""

    def __init__(
        self,
        name: str,
        agent: WorkflowNode,
        num_iterations: int = 2,
        reflection_prompt: str | None = None,
        critic_agent: WorkflowNode | None = None,
        refinement_prompt: str | None = None,
        include_history: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(name, **kwargs)
        if not isinstance(agent, WorkflowNode):
            raise ValueError("ReflectionNode needs a node as its agent")
        if not isinstance(num_iterations, int) or num_iterations < 0:
            raise ValueError(f"num_iterations must be an integer >= 0, got {num_iterations!r}")
        self.agent, self.critic_agent = agent, critic_agent or agent
        self.num_iterations, self.include_history = num_iterations, include_history
        # Under the published harness, its texts and its cuts of long replies (theirs).
        self.published = current_harness() == "published"
        self.reflection_prompt = reflection_prompt or (
            theirs.REFLECTION if self.published else REFLECTION
        )
        self.refinement_prompt = refinement_prompt or (
            theirs.REFINEMENT if self.published else REFINEMENT
        )

    def process(self, context: Context) -> Message:
        question = context.question()
        context.set_state("original_question", question)
        first = Context([Message(question, MessageType.USER_INPUT)], dict(context.state))
        result = self.agent(first)
        if result.message_type == MessageType.ERROR:
            return result
        response = as_text(result.content)
        history: list[dict[str, Any]] = [{"iteration": 0, "response": response, "reflection": None}]
        for i in range(self.num_iterations):
            shown = theirs.compact_response(response) if self.published else response
            critique = self._ask(
                self.critic_agent,
                _fill(self.reflection_prompt, question=question, response=shown),
                context,
            )
            if approved(critique):
                history.append(
                    {
                        "iteration": i + 1,
                        "response": response,
                        "reflection": critique,
                        "early_stop": True,
                    }
                )
                break
            revised = self._ask(
                self.agent, self._refinement(question, response, critique, history), context
            )
            repeated = SequenceMatcher(None, response, revised).ratio() > REPEATED
            if not repeated or "\\boxed{" in revised:
                response = revised
            history.append({"iteration": i + 1, "response": response, "reflection": critique})
            if repeated:
                break
        return Message(
            response,
            MessageType.AGENT_RESPONSE,
            {
                "num_iterations": self.num_iterations,
                "generator_agent": self.agent.name,
                "critic_agent": self.critic_agent.name,
                "history": history,
            },
        )

    def _refinement(
        self, question: str, response: str, critique: str, history: list[dict[str, Any]]
    ) -> str:
        """What the agent reads to revise its answer."""
        if self.published:  # reflection_node.py:187-222
            template = (
                theirs.REFINEMENT_WITH_HISTORY if self.include_history else self.refinement_prompt
            )
            past = theirs.reflection_history(history)
            response, critique = (
                theirs.compact_response(response),
                theirs.compact_critique(critique),
            )
        else:
            template = REFINEMENT_WITH_HISTORY if self.include_history else self.refinement_prompt
            past = "\n\n".join(
                f"Iteration {h['iteration']}:\n{h['response']}\nCritique: {h['reflection']}"
                for h in history
            )
        values = {"question": question, "response": response, "reflection": critique}
        return _fill(template, **values, history=past)

    def _ask(self, node: WorkflowNode, prompt: str, context: Context) -> str:
        return as_text(
            node(Context([Message(prompt, MessageType.USER_INPUT)], dict(context.state))).content
        )

    def describe(self) -> str:
        critic = (
            "" if self.critic_agent is self.agent else f", critic={self.critic_agent.describe()}"
        )
        return f"ReflectionNode({self.agent.describe()}{critic}, iterations={self.num_iterations})"


def _fill(template: str, **values: str) -> str:
    """`template` with {question}, {response}, ... filled; other braces (LaTeX) kept."""
    out = template
    for key, value in values.items():
        out = out.replace("{" + key + "}", value)
    return out
