"""An AutoGen coder + reviewer team on code tasks, trained with masenvs.

The team is ordinary AutoGen AgentChat: a `coder` writes the program, a `reviewer` reads it
and answers APPROVE or asks for a fix, in a `RoundRobinGroupChat`. masenvs hands `build` one
`OpenAIChatCompletionClient` per agent, pointed at the capture endpoint; the env runs the
coder's last program on hidden tests.

    python examples/autogen_code.py --model tiny --tasks-per-step 2 --branches 2 --train-steps 1
    masenvs train examples/autogen_code.yaml
"""

from __future__ import annotations

import sys

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.conditions import MaxMessageTermination, TextMentionTermination
from autogen_agentchat.teams import RoundRobinGroupChat

from masenvs.adapters.frameworks import WorkflowContext, WorkflowSpec

CODER = (
    "You are a careful Python programmer. Write the complete program in one ```python block. "
    "When the reviewer asks for changes, send the whole corrected program again."
)
REVIEWER = (
    "You review Python programs for correctness against the task. If the program is right, "
    "reply APPROVE. Otherwise name the bug in one or two sentences."
)


def build(ctx: WorkflowContext) -> RoundRobinGroupChat:
    """The factory masenvs calls for every run: clients in, team out."""
    coder = AssistantAgent("coder", model_client=ctx.clients["coder"], system_message=CODER)
    reviewer = AssistantAgent(
        "reviewer", model_client=ctx.clients["reviewer"], system_message=REVIEWER
    )
    # coder, reviewer, coder, reviewer: at most two drafts, or fewer once approved.
    done = TextMentionTermination("APPROVE", sources=["reviewer"]) | MaxMessageTermination(5)
    return RoundRobinGroupChat([coder, reviewer], termination_condition=done)


SPEC = WorkflowSpec(
    factory="examples.autogen_code:build",
    framework="autogen",
    agents=["coder", "reviewer"],
    answer_from="coder",  # the coder's last program is the team's answer
)

if __name__ == "__main__":
    from masenvs.trainer.commands.workflow import main

    sys.exit(main(SPEC, "code", sys.argv[1:], factory=build, description=__doc__))
