"""`check_env`: the masenvs env contract as one call, for the envs we ship and the ones you write.

`check_env("sudoku")`, `check_env(MyEnv)` or `check_env(functools.partial(masenvs.make,
"sudoku", size=4))` runs PettingZoo's `parallel_api_test` and the contract of
`masenvs/env.py`: turn order, reward parts, bad actions, episode end, seeds, snapshot/restore,
rendering and the Gymnasium view. The first broken promise raises an `EnvCheckError` naming
the env, the check and what differed. `tests/test_envs_contract.py` runs it on every
registered env.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from masenvs.env import IgnoredActionsWarning, MASEnv
from masenvs.registry import make as make_registered

# Builds the env under test; keyword arguments are config options (as `masenvs.make` takes).
Factory = Callable[..., MASEnv]

LEVELS = ("process", "agent", "team")
RESULTS = ("observations", "rewards", "terminations", "truncations", "infos")  # what step returns
# Weights no env uses by default, so a reward that ignores them shows.
ODD_WEIGHTS = {"process": 0.5, "agent": 2.0, "team": -1.0}
# Actions the scripted episodes play in turn: no answer, a wrong one, answer-shaped text.
SCRIPT = ("", "nothing useful", "#### [1]", "#### [R]\n\\boxed{1}")
# Actions a model can send: each must be played as a (penalised) move, never crash.
BAD_ACTIONS: tuple[Any, ...] = (
    "",
    "garbage",
    "x" * 1_000_000,
    "[" * 500,
    "#### [[[]]]",
    "```python\n",
    "lone surrogate \ud800 and NUL \x00",
    b"\xff\xfe bytes",
    None,
    12345,
)


class EnvCheckError(AssertionError):
    """An env broke the masenvs contract: `env`, the `check` it failed and what differed."""

    def __init__(self, env: str, check: str, detail: str) -> None:
        super().__init__(f"{env}: check {check!r} failed: {detail}")
        self.env, self.check, self.detail = env, check, detail


@dataclass(frozen=True)
class Step:
    """What one `step` returned, in the parts that must repeat exactly."""

    acting: str | None
    observations: dict[str, Any]
    rewards: dict[str, float]
    terminations: dict[str, bool]
    truncations: dict[str, bool]
    reward_parts: dict[str, Any]
    success: dict[str, Any]


def play(env: MASEnv, actions: Sequence[Any] = SCRIPT, max_steps: int = 24) -> list[Step]:
    """Play `actions` in turn (each at `env.acting`'s turn) until the episode ends."""
    steps: list[Step] = []
    while env.agents and len(steps) < max_steps:
        agent = env.acting
        obs, rewards, terms, truncs, infos = env.step({agent: actions[len(steps) % len(actions)]})
        parts = {a: info.get("reward_parts") for a, info in infos.items()}
        success = {a: info.get("success") for a, info in infos.items()}
        steps.append(Step(agent, obs, rewards, terms, truncs, parts, success))
    return steps


# What must repeat exactly when the same actions are played from the same state.
FIELDS = (
    "acting",
    "observations",
    "rewards",
    "terminations",
    "truncations",
    "reward_parts",
    "success",
)


def first_difference(a: list[Step], b: list[Step]) -> str | None:
    """Where two plays of the same actions part ways, in words; None when they agree."""
    for i, (x, y) in enumerate(zip(a, b)):
        for field in FIELDS:
            u, v = getattr(x, field), getattr(y, field)
            if u != v:
                return f"step {i + 1} ({x.acting}'s turn): {field} {_diff(u, v)}"
    if len(a) != len(b):
        return f"one episode ended after {len(a)} steps, the other after {len(b)}"
    return None


def _diff(u: Any, v: Any) -> str:
    if isinstance(u, dict) and isinstance(v, dict):
        for key in sorted(set(u) | set(v), key=str):
            if u.get(key) != v.get(key):
                return f"[{key!r}]: {_short(u.get(key))} != {_short(v.get(key))}"
    return f"{_short(u)} != {_short(v)}"


def _differs(x: Any, y: Any) -> bool:
    """`x != y` where it says (a task of numpy arrays does not): unknown counts as equal."""
    try:
        return bool(x != y)
    except Exception:
        return False


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _fresh(make: Factory, **options: Any) -> MASEnv:
    env = make(**options)
    if not isinstance(env, MASEnv):
        raise TypeError(f"the factory built a {type(env).__name__}, not a masenvs.MASEnv")
    return env


# --- the checks, in the order they run: the specific ones first, so a broken promise is named
# by the check that explains it rather than by PettingZoo's generic test ---------------------


def check_observations(make: Factory) -> None:
    """Every agent is live after reset and sees chat messages (system first, user last) whose
    text is its observation."""
    env = _fresh(make)
    obs, infos = env.reset(seed=5)
    assert env.agents and env.agents == env.possible_agents, (
        f"after reset env.agents is {env.agents}, expected possible_agents {env.possible_agents}"
    )
    assert env.acting == env.agents[0], f"after reset env.acting is {env.acting!r}"
    for agent in env.agents:
        assert agent in obs and agent in infos, f"reset() gave no observation or info for {agent!r}"
        messages = infos[agent].get("messages")
        assert isinstance(messages, list) and messages, f"infos[{agent!r}]['messages'] is missing"
        roles = [m.get("role") for m in messages]
        assert roles[0] == "system" and roles[-1] == "user", (
            f"{agent!r}'s messages go {roles}: expected a system message first, a user one last"
        )
        missing = [m["content"][:60] for m in messages if m["content"] not in obs[agent]]
        assert not missing, f"{agent!r}'s observation lacks its message(s) {missing}"
        assert env.observation_space(agent).contains(obs[agent]), (
            f"{agent!r}'s observation is not in its observation_space"
        )


def check_turn_order(make: Factory) -> None:
    """Agents act one after another in role order, every round; every live agent gets an
    observation, reward, termination, truncation and info at every step."""
    env = _fresh(make, max_rounds=2)
    env.reset(seed=0)
    order = list(env.possible_agents)
    if not env.config.single_agent and type(env).roles:
        assert order == list(type(env).roles), (
            f"possible_agents {order} are not the roles in turn order {list(type(env).roles)}"
        )
    seen, ended_by = [], "truncation"
    while env.agents:
        live, agent = list(env.agents), env.acting
        seen.append((env.round, agent))
        try:
            results = env.step({agent: ""})
        except ValueError as exc:
            raise AssertionError(f"env.acting is {agent!r}, but step() says: {exc}") from exc
        for name, result in zip(RESULTS, results):
            assert set(result) == set(live), (
                f"step {len(seen)} gave {name} for {sorted(result)}, expected every live agent "
                f"{sorted(live)}"
            )
        if any(results[2].values()):
            ended_by = "termination"
    expected = [(r, a) for r in range(2) for a in order]
    assert seen == expected[: len(seen)], (
        f"(round, env.acting) went {seen}, expected {expected[: len(seen)]}"
    )
    assert len(seen) == len(expected) or ended_by == "termination", (
        f"the episode ended after {len(seen)} steps without terminating; max_rounds=2 with "
        f"{len(order)} agent(s) truncates after {len(expected)}"
    )
    assert env.acting is None, f"env.acting is {env.acting!r} after the episode ended, not None"


def check_reward_parts(make: Factory) -> None:
    """Each step's `infos[agent]["reward_parts"]` holds process/agent/team, the reward is their
    sum under `reward_weights`, every agent gets the acting agent's team part and only it."""
    env = _fresh(make, reward_weights=ODD_WEIGHTS, max_rounds=2)
    env.reset(seed=1)
    for i, step in enumerate(play(env, ("garbage", *SCRIPT)), 1):
        for agent, parts in step.reward_parts.items():
            where = f"step {i} ({step.acting}'s turn), {agent!r}"
            assert isinstance(parts, dict), f"{where}: infos lack 'reward_parts'"
            assert set(parts) == set(LEVELS), f"{where}: reward_parts keys {sorted(parts)}"
            for level in LEVELS:
                assert isinstance(parts[level], (int, float)) and math.isfinite(parts[level]), (
                    f"{where}: reward_parts[{level!r}] is {parts[level]!r}, not a finite number"
                )
            total = sum(ODD_WEIGHTS[k] * parts[k] for k in LEVELS)
            assert math.isclose(step.rewards[agent], total, rel_tol=1e-9, abs_tol=1e-9), (
                f"{where}: reward {step.rewards[agent]!r} is not the parts {parts} weighted by "
                f"reward_weights {ODD_WEIGHTS} (= {total!r})"
            )
            team = step.reward_parts[step.acting]["team"]
            assert parts["team"] == team, (
                f"{where}: team part {parts['team']!r}, but the acting agent's is {team!r}"
            )
            if agent != step.acting:
                assert parts["process"] == 0 and parts["agent"] == 0, (
                    f"{where}: an agent not acting got process/agent parts {parts}"
                )


def check_bad_actions(make: Factory) -> None:
    """Any action (empty, 1 MB, binary, surrogates, not text at all) is played, never a crash;
    an env whose config declares `format_penalty` pays it for an empty answer."""
    env = _fresh(make, max_rounds=2)
    penalty = getattr(env.config, "format_penalty", None)
    for seed, action in enumerate(BAD_ACTIONS):
        env.reset(seed=seed)
        try:
            steps = play(env, (action,))
        except Exception as exc:
            raise AssertionError(
                f"step() raised {type(exc).__name__}: {exc} on the action {_short(action, 60)}: "
                "a model can send anything; score it (format_penalty) instead"
            ) from exc
        for i, step in enumerate(steps, 1):
            bad = {a: r for a, r in step.rewards.items() if not math.isfinite(r)}
            assert not bad, f"action {_short(action, 60)}, step {i}: rewards {bad} not finite"
            for agent, observation in step.observations.items():
                assert env.observation_space(agent).contains(observation), (
                    f"action {_short(action, 60)}, step {i}: {agent!r}'s observation is not in "
                    "its observation_space"
                )
            if action == "" and penalty is not None:
                got = step.reward_parts[step.acting]["agent"]
                assert got == penalty, (
                    f"an empty answer from {step.acting!r} (step {i}) got agent part {got!r}, "
                    f"not the config's format_penalty {penalty!r}"
                )


def check_episode_end(make: Factory) -> None:
    """`max_rounds` truncates after the last agent of the last round; `step` on a finished
    episode raises RuntimeError (call reset), and reset starts a new one."""
    env = _fresh(make, max_rounds=2)
    env.reset(seed=3)
    steps = play(env, ("",), max_steps=10_000)
    last = steps[-1]
    if not any(last.terminations.values()):
        assert env.round == 2 and all(last.truncations.values()), (
            f"with max_rounds=2 the episode ended at round {env.round} with truncations "
            f"{last.truncations} and no termination"
        )
        assert not any(last.success.values()), f"empty answers succeeded: {last.success}"
    assert not env.agents, "env.agents is not empty after the last step"
    try:
        env.step({})
    except RuntimeError as exc:
        assert "reset" in str(exc), f"step() after the end raised {exc!r}, which names no fix"
    else:
        raise AssertionError(
            "step() after the episode ended returned instead of raising RuntimeError "
            "('call reset() first')"
        )
    env.reset(seed=3)
    assert env.agents == env.possible_agents, "reset() after an episode did not revive agents"


def check_seeds(make: Factory, seeds_vary: bool = True) -> None:
    """The same seed and actions give the same observations and rewards, in a new env and in
    the same env's next episode; another seed gives another episode."""
    a, b = _fresh(make, max_rounds=3), _fresh(make, max_rounds=3)
    (obs_a, info_a), (obs_b, info_b) = a.reset(seed=123), b.reset(seed=123)
    assert obs_a == obs_b, f"two envs reset with seed=123 observe {_diff(obs_a, obs_b)}"
    messages = [[i["messages"] for i in info.values()] for info in (info_a, info_b)]
    assert messages[0] == messages[1], "two envs reset with seed=123 got different messages"
    first, second = play(a), play(b)
    difference = first_difference(first, second)
    assert difference is None, (
        f"same seed, same actions, two envs: {difference} (draw everything random from the "
        "generator reset() seeds, the rng generate_task gets)"
    )
    a.reset(seed=123)
    difference = first_difference(first, play(a))
    assert difference is None, f"same seed, same actions, the env's next episode: {difference}"
    if seeds_vary:
        task = a.task
        for seed in range(124, 128):
            if a.reset(seed=seed)[0] != obs_a or _differs(a.task, task):
                return
            if first_difference(first, play(a)) is not None:
                return
        raise AssertionError(
            "seeds 124-127 play exactly as seed 123: does reset use its seed? (an env with "
            "one fixed task: check_env(..., seeds_vary=False))"
        )


def check_strict_actions(make: Factory) -> None:
    """Only `env.acting`'s action is played; actions for others are ignored (or, with
    `strict_actions=True`, a ValueError); leaving out the acting agent is a ValueError."""
    env = _fresh(make)
    env.reset(seed=0)
    agent = env.acting
    others = [a for a in env.possible_agents if a != agent] or ["someone_else"]
    try:
        env.step({others[0]: "out of turn"})
    except ValueError as exc:
        assert f"it is {agent}'s turn" in str(exc), f"the ValueError {exc} names no turn"
    else:
        raise AssertionError(f"step() without {agent!r}'s action (it is its turn) did not fail")
    if len(env.possible_agents) < 2:
        return
    first, second = env.possible_agents[:2]
    alone, both = _fresh(make, strict_actions=False), _fresh(make, strict_actions=False)
    alone.reset(seed=0)
    both.reset(seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredActionsWarning)
        one = alone.step({first: "garbage"})
        two = both.step({first: "garbage", second: SCRIPT[-1]})
    assert one[0] == two[0] and one[1] == two[1], (
        f"{second!r}'s action changed {first!r}'s turn: observations/rewards "
        f"{_diff(one[:2], two[:2])}"
    )
    assert both.acting == second and both.round == 0, (
        f"after {first!r}'s step env.acting is {both.acting!r} in round {both.round}"
    )
    strict = _fresh(make, strict_actions=True)
    strict.reset(seed=0)
    try:
        strict.step({first: "x", second: "y"})
    except ValueError:
        pass
    else:
        raise AssertionError(f"strict_actions=True accepted an action for {second!r} out of turn")


def check_snapshot(make: Factory) -> None:
    """`restore(snapshot)` brings the episode back: the same actions then give the same
    observations, rewards and reward parts, however often it is restored."""
    env = _fresh(make, max_rounds=3)
    env.reset(seed=7)
    env.step({env.acting: "nothing useful"})
    at_snapshot = {a: env.observe(a) for a in env.agents}
    where = (env.round, env.acting)
    snap = env.snapshot()
    first = play(env, SCRIPT[2:] + SCRIPT[:2])
    for attempt in ("first", "second"):
        env.restore(snap)
        assert (env.round, env.acting) == where, (
            f"after the {attempt} restore (round, acting) is {(env.round, env.acting)}, "
            f"was {where} at the snapshot"
        )
        now = {a: env.observe(a) for a in env.agents}
        assert now == at_snapshot, (
            f"after the {attempt} restore, observations are not those at the snapshot: "
            f"{_diff(now, at_snapshot)} (does snapshot() deep-copy all mutable state?)"
        )
        difference = first_difference(first, play(env, SCRIPT[2:] + SCRIPT[:2]))
        assert difference is None, (
            f"the same actions after the {attempt} restore played differently: {difference} "
            "(does snapshot() deep-copy all mutable state?)"
        )


def check_render(make: Factory) -> None:
    """`ansi` renders text; grid envs (`grid_render`) render an RGB image, others refuse."""
    env = _fresh(make, render_mode="ansi")
    env.reset(seed=0)
    text = env.render()
    assert isinstance(text, str) and text, f"render() in ansi mode gave {_short(text)}"
    if not type(env).grid_render:
        try:
            make(render_mode="rgb_array")
        except ValueError as exc:
            assert "render_mode" in str(exc), f"the ValueError {exc} does not name render_mode"
            return
        raise AssertionError("render_mode='rgb_array' was accepted by an env without grid_render")
    env = _fresh(make, render_mode="rgb_array")
    env.reset(seed=0)
    image = env.render()
    assert isinstance(image, np.ndarray) and image.dtype == np.uint8, "rgb_array is no uint8 array"
    assert image.ndim == 3 and image.shape[2] == 3, f"rgb_array has shape {image.shape}"
    assert image.std() > 0, "rgb_array is one flat colour"


def check_parallel_api(make: Factory) -> None:
    """PettingZoo's `parallel_api_test`, its warnings counted as failures. Its loop passes every
    live agent's action; masenvs plays `env.acting`'s and ignores the rest (not strictly)."""
    from pettingzoo.test import parallel_api_test

    env = _fresh(make, strict_actions=False)
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", IgnoredActionsWarning)
        parallel_api_test(env, num_cycles=12)
    complaints = sorted({str(w.message) for w in caught if "pettingzoo" in w.filename})
    assert not complaints, f"parallel_api_test warned: {'; '.join(complaints)}"


def check_gymnasium(make: Factory) -> None:
    """In single-agent mode the env is a `gymnasium.Env` that passes Gymnasium's check_env."""
    from gymnasium.utils.env_checker import check_env as gymnasium_check_env

    from masenvs.wrappers import GymnasiumEnv

    gymnasium_check_env(GymnasiumEnv(_fresh(make, single_agent=True)), skip_render_check=True)


CHECKS: dict[str, Callable[[Factory], None]] = {
    "observations": check_observations,
    "turn order": check_turn_order,
    "reward parts": check_reward_parts,
    "bad actions": check_bad_actions,
    "episode end": check_episode_end,
    "seeds": check_seeds,
    "strict actions": check_strict_actions,
    "snapshot/restore": check_snapshot,
    "render": check_render,
    "parallel_api_test": check_parallel_api,
    "gymnasium": check_gymnasium,
}


def check_env(
    env: str | MASEnv | Factory,
    *,
    checks: Sequence[str] | None = None,
    seeds_vary: bool = True,
) -> None:
    """Run the masenvs env contract on `env`: a registered name, an env (rebuilt with its
    config for each check), or a factory taking config options as keywords (an env class,
    `functools.partial(masenvs.make, name, **options)`). Raises `EnvCheckError` on the first
    broken promise. `checks` picks some of `CHECKS`; `seeds_vary=False` for an env with one
    fixed task."""
    make = _factory(env)
    label = describe(_fresh(make))
    unknown = sorted(set(checks or ()) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; the checks are {list(CHECKS)}")
    for name, check in CHECKS.items():
        if checks is not None and name not in checks:
            continue
        run = (
            functools.partial(check_seeds, seeds_vary=seeds_vary) if check is check_seeds else check
        )
        try:
            run(make)
        except AssertionError as exc:
            raise EnvCheckError(label, name, str(exc) or _where(exc)) from exc
        except Exception as exc:
            raise EnvCheckError(label, name, f"raised {type(exc).__name__}: {exc}") from exc


def describe(env: MASEnv) -> str:
    """The env's name and the options that differ from its defaults: `sudoku(size=4)`."""
    options = env.config.model_dump(exclude_defaults=True)
    return f"{env.name}({', '.join(f'{k}={v!r}' for k, v in options.items())})"


def _factory(env: str | MASEnv | Factory) -> Factory:
    if isinstance(env, str):
        return functools.partial(make_registered, env)
    if isinstance(env, MASEnv):
        built = env

        def rebuild(render_mode: str | None = None, **options: Any) -> MASEnv:
            return type(built)(config=built.config, render_mode=render_mode, **options)

        return rebuild
    if callable(env):
        return env
    raise TypeError(f"check_env takes an env name, a MASEnv or a factory, not {type(env).__name__}")


def _where(exc: AssertionError) -> str:
    """A bare `assert` (PettingZoo's have no message): the line that failed."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"assertion failed at {frame.filename}:{frame.lineno}: {frame.line}"
