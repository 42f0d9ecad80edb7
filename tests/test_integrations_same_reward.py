"""Same reward everywhere: for a fixed seed and fixed actions, masenvs itself, TRL's
`environment_factory` game and the OpenEnv environment see the same observations and pay the
same rewards, in every built-in env. (verifiers runs in its own venv: tests/verifiers_env.)"""

from __future__ import annotations

import pytest

import masenvs
from masenvs.integrations.openenv import MasenvsAction, MasenvsEnvironment, Served
from masenvs.integrations.trl import environment
from masenvs.registry import list_envs

BUILT_IN = [e for e in list_envs() if e not in ("openenv", "verifiers")]
# Answers in several envs' formats at once, so some moves parse and some do not.
ACTIONS = [
    "```python\nprint('Moves: [R, D]')\n```",
    "#### [R, D]",
    "#### 42",
    "I do not know.",
    "```python\ndef solve():\n    return 42\nprint(solve())\n```",
    "#### [D, D, R]",
]
SEED = 3


def played_by_masenvs(name: str) -> tuple[list[str], list[float], dict[str, float], bool]:
    """Each acting role's observation, the reward its step paid it, PettingZoo's cumulative
    rewards of every role, and whether the episode ended."""
    env = masenvs.make(name)
    env.reset(seed=SEED)
    seen, own, returns = [], [], dict.fromkeys(env.possible_agents, 0.0)
    for action in ACTIONS:
        if not env.agents:
            break
        acting = env.acting
        seen.append(env.observe(acting))
        _, rewards, _, _, _ = env.step({acting: action})
        own.append(rewards[acting])
        for role, value in rewards.items():
            returns[role] += value
    return seen, own, returns, not env.agents


@pytest.mark.parametrize("name", BUILT_IN)
def test_trl_and_openenv_see_what_masenvs_sees(name: str) -> None:
    seen, own, returns, ended = played_by_masenvs(name)
    total = sum(returns.values())

    game = environment(name)
    player = game.factory()
    trl_seen = [player.reset(seed=SEED)]
    for action in ACTIONS[: len(seen)]:
        trl_seen.append(player.answer(action))
    rewards = game.reward(environments=[player], completions=[[]])
    assert trl_seen[: len(seen)] == seen
    assert rewards == [pytest.approx(total, abs=1e-9)]

    session = MasenvsEnvironment(Served(name, {}))
    observation = session.reset(seed=SEED)
    openenv_seen, paid = [observation.prompt], []
    for action in ACTIONS[: len(seen)]:
        observation = session.step(MasenvsAction(message=action))
        openenv_seen.append(observation.prompt)
        paid.append(observation.reward)
    assert openenv_seen[: len(seen)] == seen
    # each step's reward is the acting role's, as env.step paid it; the state keeps every
    # role's return
    assert paid == pytest.approx(own, abs=1e-9)
    assert session.state.returns == pytest.approx(returns, abs=1e-9)
    assert observation.done == session.state.done == player.done == ended
