"""Existing LangGraph, AutoGen and LlamaIndex programs as trainable masenvs policies.

Role mode (`RolePolicy`): a framework program plays one env role. Workflow mode
(`run_workflow`, `run_tasks`): a whole multi-agent program solves env tasks and is trained
on its traced calls. Frameworks are used as they ship, through their OpenAI-compatible
clients pointed at the capture endpoint; each is imported only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it; imported on first use, so that reading a config's
# `workflow:` section (and `masenvs train --help`) does not import openai and httpx.
_WHERE = {
    **dict.fromkeys(
        (
            "Clients",
            "ClientSettings",
            "autogen_client",
            "chat_openai",
            "openai_like",
            "rollout_url",
        ),
        "clients",
    ),
    **dict.fromkeys(("RunLimits", "run_program"), "programs"),
    **dict.fromkeys(("FrameworkRole", "RoleFailure", "RolePolicy"), "roles"),
    **dict.fromkeys(("WorkflowContext", "load_factory"), "factory"),
    **dict.fromkeys(("WorkflowRun", "WorkflowSpec", "run_tasks", "run_workflow"), "workflow"),
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


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
