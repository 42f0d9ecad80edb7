"""`TextEpisode`: one masenvs episode as a text game that another trainer can drive.

A trainer outside masenvs sees one policy. A multi-agent env maps to it two ways:
- `role=None`: the policy plays every role in turn order, each turn with that role's prompt
  exactly as the env renders it (`env.messages(role)`);
- `role="plan"`: the policy plays one role; the other roles are played by `others`, a fixed
  player (e.g. `openai_player(url)`, any OpenAI-compatible server such as `masenvs serve`).

Rewards are the env's: `returns[role]` is PettingZoo's cumulative reward of each role (its own
steps' mixed rewards plus the team parts of the others' steps), the same numbers `env.step`
gives for the same actions. Nothing here reads hidden tests or solutions: a policy sees
`env.messages(role)`, and `public_state()` holds counts and flags only.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from masenvs.env import MASEnv, Message
from masenvs.registry import make

LEVELS = ("process", "agent", "team")
Player = Callable[[str, list[Message]], str]  # (role, its messages) -> the role's action


@dataclass
class Turn:
    """Whose move it is and what that role sees."""

    role: str
    messages: list[Message]

    @property
    def text(self) -> str:
        """The observation as one string (the env's own `observe`)."""
        return "\n\n".join(m["content"] for m in self.messages)


@dataclass
class StepResult:
    """What one action of the policy led to (after the other roles moved, if any did)."""

    reward: float  # the policy's reward for this action and the others' moves until its next
    reward_parts: dict[str, float]  # process / agent / team, summed the same way
    done: bool
    success: bool
    next: Turn | None  # the policy's next move; None when the episode is over
    played: list[tuple[str, str]] = field(default_factory=list)  # (role, action) in order


class EpisodeOver(RuntimeError):
    """An action after the episode ended."""


class TextEpisode:
    """One masenvs env driven a turn at a time by an outside policy (see module docstring)."""

    def __init__(
        self,
        env: str | MASEnv,
        options: dict[str, Any] | None = None,
        role: str | None = None,
        others: Player | None = None,
    ) -> None:
        self.env = make(env, **(options or {})) if isinstance(env, str) else env
        roles = self.env.possible_agents
        if role is not None and role not in roles:
            raise ValueError(f"{self.env.name} has roles {roles}; {role!r} is not one of them")
        self.role = role
        self.others = others
        if role is not None and len(roles) > 1 and others is None:
            raise ValueError(
                f"training only {role!r} of {self.env.name} needs a player for "
                f"{[r for r in roles if r != role]}: pass others=openai_player(url)"
            )
        self.id = uuid.uuid4().hex
        self.returns: dict[str, float] = {}
        self.return_parts: dict[str, dict[str, float]] = {}  # returns by level (process/agent/team)
        self.steps = 0
        self.actions: list[tuple[str, str]] = []  # every (role, action) this episode, in order
        self.done = True
        self.success = False

    @property
    def name(self) -> str:
        return self.env.name

    def trains(self, role: str) -> bool:
        return self.role is None or role == self.role

    def reset(self, seed: int | None = None, task: Any = None) -> Turn:
        """Start an episode (`seed` picks the task as `env.reset` does); the policy's first turn."""
        options = {"task": task} if task is not None else None
        self.env.reset(seed=seed, options=options)
        self.id = uuid.uuid4().hex
        self.returns = dict.fromkeys(self.env.possible_agents, 0.0)
        self.return_parts = {role: dict.fromkeys(LEVELS, 0.0) for role in self.env.possible_agents}
        self.steps = 0
        self.actions = []
        self.done = False
        self.success = False
        played: list[tuple[str, str]] = []
        self._play_others(played, {})
        turn = self.turn()
        if turn is None:  # the other roles ended it before the policy moved
            raise EpisodeOver(f"{self.name}: the other roles ended the episode before the policy")
        return turn

    def turn(self) -> Turn | None:
        role = self.env.acting
        if role is None:
            return None
        return Turn(role, self.env.messages(role))

    def step(self, action: str) -> StepResult:
        """Play the policy's action, then the other roles until the policy's next turn."""
        if self.done or self.env.acting is None:
            raise EpisodeOver(f"{self.name}: the episode is over; call reset() first")
        parts = {"process": 0.0, "agent": 0.0, "team": 0.0}
        played: list[tuple[str, str]] = []
        reward = self._play(self.env.acting, action, played, parts)
        reward += self._play_others(played, parts)
        return StepResult(
            reward=reward,
            reward_parts=parts,
            done=self.done,
            success=self.success,
            next=self.turn(),
            played=played,
        )

    @property
    def reward(self) -> float:
        """The episode's return for the policy: its role's, or every role's summed."""
        return sum(r for role, r in self.returns.items() if self.trains(role))

    @property
    def reward_parts(self) -> dict[str, float]:
        """`reward` by level (unweighted process / agent / team), summed over the same roles."""
        return {
            level: sum(
                p.get(level, 0.0) for role, p in self.return_parts.items() if self.trains(role)
            )
            for level in LEVELS
        }

    def public_state(self) -> dict[str, Any]:
        """What a trainer may read about the episode: no task data, no hidden tests."""
        return {
            "episode_id": self.id,
            "env": self.name,
            "step_count": self.steps,
            "round": self.env.round,
            "acting": self.env.acting,
            "done": self.done,
            "success": self.success,
            "returns": dict(self.returns),
        }

    # --- internals ------------------------------------------------------------------------

    def _play(
        self, role: str, action: str, played: list[tuple[str, str]], parts: dict[str, float]
    ) -> float:
        """One env step; the policy's share of its rewards."""
        _, rewards, terms, truncs, infos = self.env.step({role: action})
        self.steps += 1
        played.append((role, action))
        self.actions.append((role, action))
        own = 0.0
        for agent, value in rewards.items():
            self.returns[agent] = self.returns.get(agent, 0.0) + value
            totals = self.return_parts.setdefault(agent, dict.fromkeys(LEVELS, 0.0))
            for level, v in infos[agent].get("reward_parts", {}).items():
                totals[level] = totals.get(level, 0.0) + v
            if self.trains(agent) and (self.role is not None or agent == role):
                own += value
                for level, v in infos[agent].get("reward_parts", {}).items():
                    parts[level] = parts.get(level, 0.0) + v
        self.success = any(info.get("success", False) for info in infos.values())
        self.done = not self.env.agents or any(terms.values()) or any(truncs.values())
        return own

    def _play_others(self, played: list[tuple[str, str]], parts: dict[str, float]) -> float:
        reward = 0.0
        while not self.done and self.env.acting is not None and not self.trains(self.env.acting):
            role = self.env.acting
            assert self.others is not None
            action = self.others(role, self.env.messages(role))
            reward += self._play(role, action, played, parts)
        return reward


def openai_player(
    base_url: str,
    model: str | None = None,
    api_key: str | None = None,
    temperature: float = 0.0,
    max_tokens: int = 256,
) -> Player:
    """A fixed player behind an OpenAI-compatible URL: each role's prompt goes out as chat
    messages; `model` names the model (default: the role, as `masenvs serve` routes it)."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key or "none")

    def play(role: str, messages: list[Message]) -> str:
        reply = client.chat.completions.create(
            model=model or role,
            messages=messages,  # type: ignore[arg-type]
            temperature=temperature,
            max_tokens=max_tokens,
        )
        return reply.choices[0].message.content or ""

    return play
