"""Views of a masenvs environment through other standard APIs."""

from __future__ import annotations

from typing import Any

import gymnasium

from masenvs.env import MASEnv


class GymnasiumEnv(gymnasium.Env):
    """A single-agent masenvs env as a `gymnasium.Env` (text observation, text action)."""

    def __init__(self, env: MASEnv) -> None:
        if len(env.possible_agents) != 1:
            raise ValueError(
                f"{env.name} has agents {env.possible_agents}; build it with single_agent=True "
                "to view it as a gymnasium.Env"
            )
        self.env = env
        self.agent = env.possible_agents[0]
        self.observation_space = env.observation_space(self.agent)
        self.action_space = env.action_space(self.agent)
        self.metadata = env.metadata
        self.render_mode = env.render_mode

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        observations, infos = self.env.reset(seed=seed, options=options)
        return observations[self.agent], infos[self.agent]

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        obs, rewards, terms, truncs, infos = self.env.step({self.agent: action})
        a = self.agent
        return obs[a], rewards[a], terms[a], truncs[a], infos[a]

    def render(self) -> Any:
        return self.env.render()

    def close(self) -> None:
        self.env.close()
