"""Which adapter or model serves each agent: the request's `model` names the agent."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

BASE = "base"  # the backend's name for the base model without any adapter


class UnknownModel(LookupError):
    """No adapter serves this agent; the endpoint answers 404 `model_not_found`."""


@dataclass
class PolicyMap:
    """Agent -> adapter routes, e.g. `PolicyMap({"tool": "tool_lora", "plan": "plan_lora"})`.

    An agent not in `routes` is served by the adapter of the same name if the backend has
    one, else by `default` ("base" = the base model); `default=None` rejects such agents.
    `chat_template_kwargs` holds per-agent template variables (`{"plan": {"enable_thinking":
    False}}`): they apply to every chat call of the agent, under the request's own.
    """

    routes: dict[str, str] = field(default_factory=dict)
    default: str | None = BASE
    chat_template_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    # False: only `routes` name agents; any other name gets `default`, even one that names a
    # loaded adapter (training: a call is a policy's only when its agent is declared).
    adapters_by_name: bool = True
    reject_hint: str = ""  # appended to the error for a rejected name: how to fix it
    rejected: set[str] = field(default_factory=set, compare=False)  # names refused so far

    def template_kwargs(self, agent: str, requested: dict[str, Any]) -> dict[str, Any]:
        """The chat template variables of one call: the agent's defaults, then the request's."""
        return {**self.chat_template_kwargs.get(agent, {}), **requested}

    def resolve(self, agent: str, available: Collection[str]) -> str:
        """The backend model name for `agent`; `available` is what the backend can serve."""
        if agent in self.routes:
            target = self.routes[agent]
            if target != BASE and target not in available:
                raise UnknownModel(
                    f"Agent {agent!r} maps to adapter {target!r}, which the backend has not "
                    f"loaded (loaded: {', '.join(sorted(available)) or 'none'})."
                )
            return target
        if self.adapters_by_name and agent in available:
            return agent
        if self.default is None:
            self.rejected.add(agent)
            known = ", ".join(sorted(self.routes)) or "none"
            if not self.adapters_by_name:
                raise UnknownModel(
                    f"The model {agent!r} is not an agent ({known}){self.reject_hint}."
                )
            loaded = ", ".join(sorted(set(available) - {BASE})) or "none"
            raise UnknownModel(
                f"The model {agent!r} does not exist: it is neither an agent of the policy map "
                f"({known}) nor a loaded model ({loaded}){self.reject_hint}."
            )
        if self.default != BASE and self.default not in available:
            raise UnknownModel(
                f"Agent {agent!r} falls back to adapter {self.default!r}, which is not loaded."
            )
        return self.default
