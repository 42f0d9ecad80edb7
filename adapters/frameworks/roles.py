"""Role mode: a framework program plays one env role; the other roles keep `ChatPolicy`.

    policy = RolePolicy(server.url, {
        "plan": FrameworkRole("langgraph", build_planner_graph),   # build(client) -> program
        "tool": FrameworkRole("autogen", lambda client: AssistantAgent("tool", client)),
    })
    result = await run_episode(env, policy, seed=0)

Every act builds the role's program from a client pointed at the rollout's endpoint URL
with the role as model name, runs it on the role's chat messages and returns its final text
as the action. `RolePolicy.act` and `act_all` have `ChatPolicy`'s signatures, so
`run_episode` and the tree sampler (which ask the acting agent at each turn) use it unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from masenvs.adapters.frameworks.calls import read_calls
from masenvs.adapters.frameworks.clients import Clients, ClientSettings, Framework, rollout_url
from masenvs.adapters.frameworks.programs import (
    Isolation,
    Messages,
    RunLimits,
    check_program,
    failure_reason,
    run_isolated,
    run_program,
    warn_if_empty,
)
from masenvs.adapters.policy import ChatPolicy, Reply, server_root
from masenvs.traces import TraceStore

log = logging.getLogger("masenvs.frameworks")

RoleFactory = Callable[[Any], Any]
"""client -> program: builds the role's program (graph, team, workflow) around its client."""


class RoleFailure(RuntimeError):
    """A role's framework program raised; `run_episode` ends the episode with this reason."""

    def __init__(self, role: str, reason: str) -> None:
        super().__init__(f"role {role!r} failed: {reason}")
        self.role = role
        self.reason = reason


@dataclass
class FrameworkRole:
    """An env role played by a framework program built around the role's client."""

    framework: Framework
    build: RoleFactory  # may be async
    limits: RunLimits = field(default_factory=RunLimits)
    settings: ClientSettings | None = None  # None: the RolePolicy's settings


class RolePolicy:
    """Framework programs for some roles, `ChatPolicy` for the rest; `act_all` as ChatPolicy.

    `on_failure="raise"` ends the episode when a program fails (the failure is logged with
    its reason); `"empty"` plays an empty action instead, which the env scores as an invalid
    move. With `store`, each reply's `completion_tokens` is read from the trace.
    """

    def __init__(
        self,
        base_url: str,
        roles: Mapping[str, FrameworkRole],
        *,
        fallback: ChatPolicy | None = None,
        settings: ClientSettings | None = None,
        on_failure: Literal["raise", "empty"] = "raise",
        store: TraceStore | None = None,
    ) -> None:
        if on_failure not in ("raise", "empty"):
            raise ValueError(f"on_failure must be 'raise' or 'empty', not {on_failure!r}")
        self.root_url = server_root(base_url)
        self.base_url = f"{self.root_url}/v1"
        self.roles = dict(roles)
        self.settings = settings or ClientSettings()
        self.on_failure = on_failure
        self.store = store
        self._fallback = fallback
        self._own_fallback = fallback is None

    @property
    def fallback(self) -> ChatPolicy:
        if self._fallback is None:
            self._fallback = ChatPolicy(
                self.base_url,
                api_key=self.settings.api_key,
                sampling=self.settings.sampling,
                agent_sampling=self.settings.agents,
            )
        return self._fallback

    async def act(
        self, rollout_id: str, agent: str, messages: Messages, n: int = 1, seed: int | None = None
    ) -> list[Reply]:
        """`n` answers of `agent`: n runs of its program (concurrent), or ChatPolicy's.
        `seed` reaches the fallback's call only: a program makes its own calls."""
        role = self.roles.get(agent)
        if role is None:
            return await self.fallback.act(rollout_id, agent, messages, n=n, seed=seed)
        started = time.time()
        texts = await asyncio.gather(
            *(self._run_role(rollout_id, agent, role, messages) for _ in range(n))
        )
        tokens = self._completion_tokens(rollout_id, agent, started, n)
        return [Reply(text=t, completion_tokens=tokens, finish_reason="stop") for t in texts]

    async def act_all(
        self, rollout_id: str, infos: dict[str, dict[str, Any]], n: int = 1
    ) -> dict[str, list[Reply]]:
        """Every live agent's answers to its current prompt, all agents concurrently."""
        agents = list(infos)
        results = await asyncio.gather(
            *(self.act(rollout_id, a, infos[a]["messages"], n=n) for a in agents)
        )
        return dict(zip(agents, results))

    async def _run_role(
        self, rollout_id: str, agent: str, role: FrameworkRole, messages: Messages
    ) -> str:
        url = rollout_url(self.root_url, rollout_id)
        settings = role.settings or self.settings
        limits = dataclasses.replace(role.limits, timeout_s=None)  # the thread's deadline rules

        async def body(isolation: Isolation) -> str:
            # Runs in a thread and event loop of its own: a blocking program stalls only itself.
            clients = Clients(role.framework, url, [agent], settings)
            isolation.on_timeout.append(lambda: clients.revoke(f"role {agent} timed out"))
            try:
                program = role.build(clients[agent])
                if inspect.isawaitable(program):
                    program = await program
                check_program(role.framework, program)
                return await run_program(role.framework, program, messages, limits)
            finally:
                await clients.aclose()

        try:
            answer = await run_isolated(
                body, role.limits.timeout_s, Isolation(f"masenvs-role-{rollout_id}-{agent}")
            )
            kind = ("role", agent, role.framework, role.limits.answer_from)
            where = f"rollout {rollout_id}: role {agent} ({role.framework})"
            warn_if_empty(answer, kind, role.framework, role.limits.answer_from, where)
            return answer
        except Exception as exc:
            reason = failure_reason(exc)
            log.warning(
                "rollout %s: role %s (%s) failed: %s", rollout_id, agent, role.framework, reason
            )
            if self.on_failure == "empty":
                return ""
            raise RoleFailure(agent, reason) from exc

    def _completion_tokens(self, rollout_id: str, agent: str, since: float, n: int) -> int:
        if self.store is None:
            return 0
        calls = [c for c in read_calls(self.store, [rollout_id], since=since) if c.agent == agent]
        total = sum(len(choice.token_ids) for c in calls for choice in c.choices)
        return total // n  # n candidates ran concurrently: their calls cannot be told apart

    async def aclose(self) -> None:
        if self._own_fallback and self._fallback is not None:
            await self._fallback.aclose()
