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
        if seed is None:  # the next task of this env's own seeded stream, as Gymnasium expects
            seed = int(self.np_random.integers(1 << 31))
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


# -- registered Gymnasium ids: gymnasium.make("masenvs/plan_path-v0") -----------------------

GYM_NAMESPACE = "masenvs"


def gym_id(name: str) -> str:
    """The Gymnasium id of a masenvs env: `masenvs/<name>-v0`."""
    return f"{GYM_NAMESPACE}/{name}-v0"


def make_gymnasium(env_name: str, render_mode: str | None = None, **options: Any) -> GymnasiumEnv:
    """A masenvs env in single-agent mode as a `gymnasium.Env` (the registered ids' entry
    point); `options` are the env's config fields."""
    from masenvs.registry import make

    return GymnasiumEnv(
        make(env_name, render_mode=render_mode, **{**options, "single_agent": True})
    )


def register_gymnasium(name: str) -> None:
    """Register `masenvs/<name>-v0` with Gymnasium (done for every env at `import masenvs`)."""
    env_id = gym_id(name)
    if env_id in gymnasium.registry:
        return
    gymnasium.register(
        id=env_id,
        entry_point="masenvs.wrappers:make_gymnasium",
        kwargs={"env_name": name},
        # The env truncates after its own max_rounds; Gymnasium's checker is passed already.
        disable_env_checker=True,
    )


def make_vec(name: str, num_envs: int, **options: Any) -> gymnasium.vector.VectorEnv:
    """`num_envs` copies of a single-agent env stepped together (a `SyncVectorEnv`): a
    batch of text observations in, a batch of text actions out."""
    return gymnasium.make_vec(gym_id(name), num_envs=num_envs, vectorization_mode="sync", **options)
