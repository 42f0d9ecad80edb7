"""The contract every registered environment keeps (DESIGN.md, Contracts: Environment)."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pettingzoo.test import parallel_api_test

import masenvs
from masenvs.wrappers import GymnasiumEnv

# The envs masenvs ships; test modules register toy envs of their own (test_vllm_real's),
# which collection may import first.
ENVS = [
    n
    for n in masenvs.list_envs()
    if masenvs.registry.env_class(n).__module__.startswith("masenvs.")
]
# Envs with two or more roles acting through `step` (auto-MAS's executor acts inside it).
TEAMS = [name for name in ENVS if len(masenvs.make(name).possible_agents) > 1]
MODES = [pytest.param(False, id="multi"), pytest.param(True, id="single")]
TURN_ORDERS = ["sequential", "simultaneous"]


@pytest.mark.parametrize("turn_order", TURN_ORDERS)
@pytest.mark.parametrize("single_agent", MODES)
@pytest.mark.parametrize("name", ENVS)
def test_parallel_api(name: str, single_agent: bool, turn_order: str) -> None:
    env = masenvs.make(name, single_agent=single_agent, turn_order=turn_order)
    parallel_api_test(env, num_cycles=12)


@pytest.mark.parametrize("turn_order", TURN_ORDERS)
@pytest.mark.parametrize("name", ENVS)
def test_agents_take_turns_in_role_order(name: str, turn_order: str) -> None:
    env = masenvs.make(name, max_rounds=2, turn_order=turn_order)
    env.reset(seed=0)
    order = list(masenvs.env_class(name).roles)
    assert env.agents == order
    seen = []
    while env.agents:
        seen.append((env.round, env.acting))
        _, rewards, _, _, infos = env.step(dict.fromkeys(env.agents, ""))
        assert set(rewards) == set(order)  # every live agent gets a reward every step
    assert seen == [(r, agent) for r in range(2) for agent in order]


@pytest.mark.parametrize("name", TEAMS)
def test_actions_of_agents_not_due_are_ignored(name: str) -> None:
    env = masenvs.make(name)
    env.reset(seed=0)
    first, second = env.possible_agents
    snap = env.snapshot()
    alone = env.step({first: "garbage"})
    env.restore(snap)
    both = env.step({first: "garbage", second: "#### [R]\n\\boxed{1}"})
    assert alone[1] == both[1] and alone[0] == both[0]
    assert env.acting == second and env.round == 0
    with pytest.raises(ValueError, match=f"it is {second}'s turn"):
        env.step({first: "out of turn"})


@pytest.mark.parametrize("name", ENVS)
def test_gymnasium_view_passes_check_env(name: str) -> None:
    env = GymnasiumEnv(masenvs.make(name, single_agent=True))
    check_env(env, skip_render_check=True)
    assert isinstance(env, gymnasium.Env)


@pytest.mark.parametrize("name", ENVS)
def test_reset_is_deterministic_under_a_seed(name: str) -> None:
    a, b = masenvs.make(name), masenvs.make(name)
    obs_a, info_a = a.reset(seed=123)
    obs_b, info_b = b.reset(seed=123)
    assert obs_a == obs_b
    assert [i["messages"] for i in info_a.values()] == [i["messages"] for i in info_b.values()]
    other, _ = b.reset(seed=124)
    assert other != obs_a


@pytest.mark.parametrize("name", ENVS)
def test_observations_are_the_messages_as_text(name: str) -> None:
    env = masenvs.make(name)
    obs, infos = env.reset(seed=5)
    for agent in env.agents:
        messages = infos[agent]["messages"]
        assert messages[0]["role"] == "system" and messages[-1]["role"] == "user"
        assert all(m["content"] in obs[agent] for m in messages)
        assert env.observation_space(agent).contains(obs[agent])


@pytest.mark.parametrize("name", ENVS)
def test_snapshot_restore_gives_identical_futures(name: str) -> None:
    env = masenvs.make(name, max_rounds=3)
    env.reset(seed=7)
    env.step(dict.fromkeys(env.agents, "nothing useful"))
    snap = env.snapshot()
    actions = dict.fromkeys(env.agents, "#### [1]")
    first = env.step(actions)
    env.restore(snap)
    second = env.step(actions)
    assert first[0] == second[0] and first[1] == second[1]
    assert [i["reward_parts"] for i in first[4].values()] == [
        i["reward_parts"] for i in second[4].values()
    ]


@pytest.mark.parametrize("name", ENVS)
def test_rewards_combine_parts_with_configured_weights(name: str) -> None:
    weights = {"process": 0.5, "agent": 2.0, "team": -1.0}
    env = masenvs.make(name, reward_weights=weights)
    env.reset(seed=1)
    _, rewards, _, _, infos = env.step(dict.fromkeys(env.agents, "garbage"))
    for agent, reward in rewards.items():
        parts = infos[agent]["reward_parts"]
        assert reward == pytest.approx(sum(weights[k] * parts[k] for k in weights))


@pytest.mark.parametrize("name", ENVS)
def test_episode_ends_after_max_rounds(name: str) -> None:
    env = masenvs.make(name, max_rounds=2)
    env.reset(seed=3)
    masenvs.play_round(env, dict.fromkeys(env.agents, ""))
    assert env.agents and env.round == 1
    _, _, terms, truncs, infos = masenvs.play_round(env, dict.fromkeys(env.agents, ""))
    assert not env.agents and all(truncs.values()) and not any(terms.values())
    assert not any(i["success"] for i in infos.values())
    with pytest.raises(RuntimeError, match="reset"):
        env.step({})


@pytest.mark.parametrize("name", ENVS)
def test_grid_envs_render_rgb(name: str) -> None:
    if not masenvs.env_class(name).grid_render:
        with pytest.raises(ValueError, match="render_mode"):
            masenvs.make(name, render_mode="rgb_array")
        return
    env = masenvs.make(name, render_mode="rgb_array")
    env.reset(seed=0)
    image = env.render()
    assert isinstance(image, np.ndarray) and image.dtype == np.uint8
    assert image.ndim == 3 and image.shape[2] == 3 and image.std() > 0


@pytest.mark.parametrize("name", ENVS)
def test_ansi_render_is_text(name: str) -> None:
    env = masenvs.make(name, render_mode="ansi")
    env.reset(seed=0)
    assert isinstance(env.render(), str) and env.render()


def test_the_mission_envs_are_registered_and_so_under_contract() -> None:
    assert {"plan_path", "sudoku", "sokoban", "math", "code", "verilog"} <= set(ENVS)


def test_unknown_env_and_bad_config_fail_clearly() -> None:
    with pytest.raises(KeyError, match="known environments"):
        masenvs.make("no_such_env")
    with pytest.raises(ValueError, match="max_rounds"):
        masenvs.make("plan_path", max_rounds=0)
    with pytest.raises(ValueError, match="no_such_field"):
        masenvs.make("plan_path", no_such_field=1)


# Arbitrary text (empty, huge, binary-looking, unicode, lone surrogates) is a legal action.
_TEXT = st.one_of(
    st.text(max_size=300),
    st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
    st.sampled_from(["", "#### ", "####", "```python\n", "[" * 500, "\ud800", "#### [[[]]]"]),
    st.just("x" * 1_000_000),
)


@pytest.mark.parametrize("name", ENVS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(texts=st.lists(_TEXT, min_size=2, max_size=2))
def test_any_text_is_a_legal_action(name: str, texts: list[str]) -> None:
    env = masenvs.make(name, max_rounds=2)
    env.reset(seed=0)
    while env.agents:
        obs, rewards, *_ = env.step(dict(zip(env.agents, texts * 2)))
        assert all(np.isfinite(r) for r in rewards.values())
