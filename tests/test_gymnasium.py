"""The Gymnasium view: registered ids, a vector env of single-agent envs; and the PettingZoo
loop that passes every agent's action, which plays only `env.acting`'s and says so once."""

from __future__ import annotations

import subprocess
import sys
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import masenvs
from masenvs.env import _WARNED_IGNORED


@pytest.mark.parametrize("name", ["plan_path", "sudoku", "sokoban"])
def test_every_env_has_a_registered_gymnasium_id(name: str) -> None:
    env = gymnasium.make(f"masenvs/{name}-v0")
    obs, info = env.reset(seed=3)
    assert isinstance(obs, str) and info["messages"][-1]["content"] in obs
    obs, reward, terminated, truncated, info = env.step("no answer")
    assert isinstance(reward, float) and not terminated and "reward_parts" in info
    check_env(env.unwrapped)
    # The same task as the env made directly, in single-agent mode
    direct = masenvs.make(name, single_agent=True)
    first, _ = direct.reset(seed=3)
    assert first[direct.possible_agents[0]] == env.reset(seed=3)[0]


def test_registered_ids_take_env_options_and_the_module_prefix() -> None:
    env = gymnasium.make("masenvs/sudoku-v0", size=9, max_rounds=2)
    assert env.unwrapped.env.config.size == 9 and env.unwrapped.env.config.max_rounds == 2
    # A fresh interpreter: "masenvs:" imports masenvs, which registers the ids.
    code = "import gymnasium; e = gymnasium.make('masenvs:masenvs/plan_path-v0'); e.reset(seed=0)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_vector_env_steps_single_agent_envs_together() -> None:
    envs = masenvs.make_vec("plan_path", 3, size=4)
    try:
        obs, _ = envs.reset(seed=0)
        assert len(obs) == 3 and all(isinstance(o, str) for o in obs)
        assert len(set(obs)) == 3  # three tasks (seeds 0, 1, 2)
        obs, rewards, terms, truncs, _ = envs.step(("#### [U]", "nothing", "#### [L, L]"))
        assert rewards.shape == (3,) and terms.shape == truncs.shape == (3,)
        assert rewards[1] < 0  # no moves: the format penalty
    finally:
        envs.close()


def test_the_pettingzoo_loop_plays_only_the_acting_agent_and_warns_once() -> None:
    _WARNED_IGNORED.discard(masenvs.env_class("plan_path"))
    env = masenvs.make("plan_path")
    env.reset(seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env.step({agent: "#### [U]" for agent in env.agents})  # tool acts; plan's ignored
        env.step({agent: "#### [U]" for agent in env.agents})  # plan acts; tool's ignored
    ignored = [w for w in caught if issubclass(w.category, masenvs.IgnoredActionsWarning)]
    assert len(ignored) == 1
    message = str(ignored[0].message)
    assert "plays only env.acting's action ('tool')" in message and "'plan'" in message
    assert ignored[0].filename == __file__  # points at the caller's step()
    assert env.round == 1  # two steps: one round, one action each


def test_strict_actions_turns_the_warning_into_an_error() -> None:
    env = masenvs.make("sudoku", strict_actions=True)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"ignored the actions of .*strict_actions"):
        env.step({agent: "x" for agent in env.agents})
    env.step({env.acting: "x"})  # the turn's own action is fine
    masenvs.play_round(env, {agent: "x" for agent in env.possible_agents})  # plays each turn
