"""Existing LangGraph, AutoGen and LlamaIndex programs as trainable masenvs policies.

Role mode (`RolePolicy`): a framework program plays one env role. Workflow mode
(`run_workflow`, `run_tasks`): a whole multi-agent program solves env tasks and is trained
on its traced calls. Frameworks are used as they ship, through their OpenAI-compatible
clients pointed at the capture endpoint; each is imported only when used.
"""

from masenvs.adapters.frameworks.clients import (
    Clients,
    ClientSettings,
    autogen_client,
    chat_openai,
    openai_like,
    rollout_url,
)
from masenvs.adapters.frameworks.programs import RunLimits, run_program
from masenvs.adapters.frameworks.roles import FrameworkRole, RoleFailure, RolePolicy
from masenvs.adapters.frameworks.workflow import (
    WorkflowContext,
    WorkflowRun,
    WorkflowSpec,
    load_factory,
    run_tasks,
    run_workflow,
)

__all__ = [
    "ClientSettings",
    "Clients",
    "FrameworkRole",
    "RoleFailure",
    "RolePolicy",
    "RunLimits",
    "WorkflowContext",
    "WorkflowRun",
    "WorkflowSpec",
    "autogen_client",
    "chat_openai",
    "load_factory",
    "openai_like",
    "rollout_url",
    "run_program",
    "run_tasks",
    "run_workflow",
]
