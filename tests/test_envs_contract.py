"""The contract every registered environment keeps (DESIGN.md, Contracts: Environment): the
library's own `check_env` in both modes and turn orders, plus a property-based fuzz of actions."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import masenvs
from masenvs.testing import check_env

# The envs masenvs ships; test modules register toy envs of their own (test_vllm_real's),
# which collection may import first.
ENVS = [
    n
    for n in masenvs.list_envs()
    if masenvs.registry.env_class(n).__module__.startswith("masenvs.")
]
MODES = [pytest.param(False, id="multi"), pytest.param(True, id="single")]
TURN_ORDERS = ["sequential", "simultaneous"]


@pytest.mark.parametrize("turn_order", TURN_ORDERS)
@pytest.mark.parametrize("single_agent", MODES)
@pytest.mark.parametrize("name", ENVS)
def test_env_keeps_the_contract(name: str, single_agent: bool, turn_order: str) -> None:
    """masenvs.testing.check_env: PettingZoo's parallel_api_test, turn order, reward parts,
    bad actions, episode end, seeds, strict actions, snapshot/restore, rendering, Gymnasium."""
    check_env(
        functools.partial(masenvs.make, name, single_agent=single_agent, turn_order=turn_order)
    )


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
