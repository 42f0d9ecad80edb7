"""Paired team credit (`rollout.team_credit: paired`): each candidate of an agent that acts
before the round's last actor is credited with the team term of *its own* continuation.

In a tree the team outcome of a round is decided by a later agent (plan-path's plan after the
tool; math's reasoner after the tool). With committed credit (`RoundCredit`) every candidate
of the earlier agent gets the committed path's term: one constant per group, so it moves no
advantage. PettingLLMs at 0cff56f (sequential mode, the paper's) paired plan candidate k with
tool candidate k on branch k, so the tool's team term was its own continuation's outcome
(`tool_agent.py:93-136`). Here, after the agent's K candidates are played, each branch k is
copied onto a spare env and the round is played to its end there: every later agent answers
once (n=1) on branch k, and candidate k gets the `alpha * team` terms those steps pay it.

The continuations cost one extra call per later agent per candidate (`paired_calls`). Their
answers are not training samples: each is one answer from its own state, so it has no group
of K to be compared in, and the later agents' K candidates are sampled, grouped and trained
on the committed path as before. Runs an env step makes through the endpoint during a
continuation (auto-MAS executions) are not kept either. Which branch continues is still
`select_by`'s choice; the continuations only score.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Literal

from masenvs.adapters.policy import ChatPolicy
from masenvs.env import MASEnv

TeamCredit = Literal["committed", "paired"]


class Continuations:
    """One task's continuations: its policy, and a spare env per branch, made on first use.

    `seed_of(round, k, actor)`: the seed of `actor`'s call on branch k (None: unseeded).
    """

    def __init__(
        self,
        make_env: Callable[[], MASEnv],
        policy: ChatPolicy,
        rollout_id: str,
        seed_of: Callable[[int, int, str], int | None],
    ) -> None:
        self.make_env, self.policy, self.rollout_id = make_env, policy, rollout_id
        self.seed_of = seed_of
        self.envs: list[MASEnv] = []
        self.calls = 0  # policy calls the continuations made (`train/paired_calls`)

    async def team_terms(
        self, agent: str, round_: int, branches: list[tuple[MASEnv, dict[str, dict[str, Any]]]]
    ) -> list[float]:
        """The team term each branch's continuation pays `agent`, in branch order.

        `branches[k]`: branch k's env just after candidate k's step, and that step's infos
        (they hold the next agent's prompt).
        """
        while len(self.envs) < len(branches):
            self.envs.append(self.make_env())
        terms = await asyncio.gather(
            *(
                self._continue(agent, round_, k, branch, infos)
                for k, (branch, infos) in enumerate(branches)
            )
        )
        return list(terms)

    async def _continue(
        self, agent: str, round_: int, k: int, branch: MASEnv, infos: dict[str, dict[str, Any]]
    ) -> float:
        """Play the rest of the round on a copy of branch k, one answer per later agent."""
        env = self.envs[k]
        env.restore(branch.snapshot())  # branch k itself stays as it is: it may be committed
        term = 0.0
        while env.agents and env.turn != 0:  # turn 0: the round is over
            actor = env.acting
            assert actor is not None
            seed = self.seed_of(round_, k, actor)
            extra = {} if seed is None else {"seed": seed}
            messages = infos[actor]["messages"]
            replies = await self.policy.act(self.rollout_id, actor, messages, n=1, **extra)
            self.calls += 1
            if not replies:
                raise RuntimeError(f"the policy returned no answer for {actor!r} (paired credit)")
            _, rewards, _, _, infos = await asyncio.to_thread(env.step, {actor: replies[0].text})
            term += rewards.get(agent, 0.0)  # alpha * team, as the env pays every live agent
        return term
