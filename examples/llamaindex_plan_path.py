"""A LlamaIndex `AgentWorkflow` (navigator + reviewer) on plan-path, trained with masenvs.

The workflow is ordinary LlamaIndex: a `navigator` agent plans the moves (it has a tool that
checks the answer's format) and may hand off to a `reviewer` agent, which may hand back.
masenvs hands `build` one `OpenAILike` LLM per agent, pointed at the capture endpoint; the
env walks the final answer's moves on the grid.

    python examples/llamaindex_plan_path.py --model tiny --tasks-per-step 2 --branches 2 --train-steps 1
    masenvs train examples/llamaindex_plan_path.yaml
"""

from __future__ import annotations

import sys

from llama_index.core.agent.workflow import AgentWorkflow, FunctionAgent

from masenvs.adapters.frameworks import WorkflowContext, WorkflowSpec
from masenvs.parsing import parse_moves

NAVIGATOR = (
    "You plan paths on grids. Think about the route, check your answer with the "
    "check_format tool, and end with `#### [moves]`, e.g. `#### [R, R, D]`. Hand off to the "
    "reviewer if you are unsure."
)
REVIEWER = (
    "You review a proposed path for walls and wrong turns. Give the corrected final answer, "
    "ending with `#### [moves]`."
)


def check_format(answer: str) -> str:
    """Say whether `answer` ends with a readable `#### [moves]` list, and which moves."""
    moves = parse_moves(answer)
    if moves is None:
        return "No moves found: end with `#### [U, D, L, R, ...]`."
    return f"Readable: {len(moves)} moves {''.join(moves)}."


def build(ctx: WorkflowContext) -> AgentWorkflow:
    """The factory masenvs calls for every run: LLMs in, agent workflow out."""
    navigator = FunctionAgent(
        name="navigator",
        description="Plans the path and gives the final moves.",
        system_prompt=NAVIGATOR,
        llm=ctx.clients["navigator"],
        tools=[check_format],
        can_handoff_to=["reviewer"],
    )
    reviewer = FunctionAgent(
        name="reviewer",
        description="Checks a proposed path and corrects it.",
        system_prompt=REVIEWER,
        llm=ctx.clients["reviewer"],
        can_handoff_to=["navigator"],
    )
    return AgentWorkflow(agents=[navigator, reviewer], root_agent="navigator", timeout=None)


SPEC = WorkflowSpec(
    factory="examples.llamaindex_plan_path:build",
    framework="llamaindex",
    agents=["navigator", "reviewer"],
)

if __name__ == "__main__":
    from masenvs.trainer.commands.workflow import main

    sys.exit(main(SPEC, "plan_path", sys.argv[1:], factory=build, description=__doc__))
