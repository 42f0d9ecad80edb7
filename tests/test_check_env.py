"""`masenvs.testing.check_env` passes a good env and names what is broken in a bad one."""

from __future__ import annotations

import functools
import random
import re
import runpy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import masenvs
from masenvs import EnvConfig, MASEnv, RewardParts
from masenvs.env import EpisodeState
from masenvs.testing import CHECKS, EnvCheckError, check_env

DOCS = Path(__file__).resolve().parents[1] / "docs"


class GuessConfig(EnvConfig):
    format_penalty: float = -1.0


@dataclass
class GuessState(EpisodeState):
    guesses: list[int] = field(default_factory=list)


class GuessEnv(MASEnv):
    """A scout and a guesser name a digit; the guesser's guess is the team's answer."""

    name = "guess"
    roles = ("scout", "guesser")
    solo_role = "guesser"
    config_class = GuessConfig

    def generate_task(self, rng: np.random.Generator) -> int:
        return int(rng.integers(10))

    def initial_state(self, task: int) -> GuessState:
        return GuessState()

    def prompt(self, agent: str) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": f"You are the {agent}. Name a digit from 0 to 9."},
            {"role": "user", "content": f"Guesses so far: {self.state.guesses}."},
        ]

    def parse(self, action: str) -> int | None:
        digits = [c for c in action if c in "0123456789"]
        return int(digits[0]) if digits else None

    def play_turn(self, agent: str, action: str) -> RewardParts:
        guess = self.parse(action)
        if guess is None:
            self.last_feedback[agent] = "No digit."
            return RewardParts(agent=self.config.format_penalty)
        self.state.guesses.append(guess)
        right = guess == self.task
        self.last_feedback[agent] = "Right." if right else "Wrong."
        closeness = -abs(guess - self.task) / 9
        if agent != "guesser":
            return RewardParts(process=closeness, agent=float(right))
        self.state.success = right
        return RewardParts(process=closeness, agent=float(right), team=1.0 if right else closeness)


# --- deliberately broken envs: each breaks one promise of masenvs/env.py ---------------------


class SnapshotSharesState(GuessEnv):
    """snapshot() keeps a reference to the live state, so playing on mutates the snapshot."""

    def snapshot(self) -> masenvs.Snapshot:
        snap = super().snapshot()
        snap.state = self.state
        return snap

    def restore(self, snapshot: masenvs.Snapshot) -> None:
        super().restore(snapshot)
        self.state = snapshot.state


class ActingIsAlwaysTheFirstRole(GuessEnv):
    """env.acting names the first role whoever is due."""

    @property
    def acting(self) -> str | None:
        return self.agents[0] if self.agents else None


class RolesOutOfOrder(GuessEnv):
    """The agents act guesser first, against the declared role order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.possible_agents = list(reversed(self.possible_agents))


class RewardIgnoresWeights(GuessEnv):
    """The reward is the plain sum of the parts, whatever reward_weights says."""

    def step(self, actions):
        obs, rewards, terms, truncs, infos = super().step(actions)
        rewards = {a: float(sum(i["reward_parts"].values())) for a, i in infos.items()}
        return obs, rewards, terms, truncs, infos


class RewardPartsMissing(GuessEnv):
    """infos carry no reward_parts."""

    def step(self, actions):
        obs, rewards, terms, truncs, infos = super().step(actions)
        for info in infos.values():
            info.pop("reward_parts")
        return obs, rewards, terms, truncs, infos


class TeamRewardOnlyToTheActor(GuessEnv):
    """The team part reaches the agent that acted, not its teammates."""

    def step(self, actions):
        agent = self.acting
        obs, rewards, terms, truncs, infos = super().step(actions)
        for other, info in infos.items():
            if other != agent:
                info["reward_parts"]["team"] = 0.0
                rewards[other] = 0.0
        return obs, rewards, terms, truncs, infos


class ResetIgnoresSeed(GuessEnv):
    """The task comes from Python's global random, not the seeded generator."""

    def generate_task(self, rng: np.random.Generator) -> int:
        return random.randrange(10**9)


class CrashesOnUnicode(GuessEnv):
    """The parser assumes ASCII: a model's emoji or a lone surrogate crashes step()."""

    def parse(self, action: str) -> int | None:
        return super().parse(action.encode("ascii").decode())


class NoFormatPenalty(GuessEnv):
    """The config declares format_penalty, but an empty answer is paid 0."""

    def play_turn(self, agent: str, action: str) -> RewardParts:
        parts = super().play_turn(agent, action)
        return RewardParts() if not action else parts


class StepAfterEndReturns(GuessEnv):
    """step() on a finished episode returns empty results instead of asking for reset()."""

    def step(self, actions):
        if not self.agents:
            return {}, {}, {}, {}, {}
        return super().step(actions)


BROKEN = [
    (SnapshotSharesState, "snapshot/restore", "after the first restore, observations"),
    (ActingIsAlwaysTheFirstRole, "turn order", "it is guesser's turn"),
    (RolesOutOfOrder, "turn order", "are not the roles in turn order"),
    (RewardIgnoresWeights, "reward parts", "is not the parts"),
    (RewardPartsMissing, "reward parts", "infos lack 'reward_parts'"),
    (TeamRewardOnlyToTheActor, "reward parts", "but the acting agent's is"),
    (ResetIgnoresSeed, "seeds", "same seed, same actions, two envs: step"),
    (CrashesOnUnicode, "bad actions", "step() raised UnicodeEncodeError"),
    (NoFormatPenalty, "bad actions", "not the config's format_penalty -1.0"),
    (StepAfterEndReturns, "episode end", "returned instead of raising"),
]


@pytest.mark.parametrize(("broken", "check", "says"), BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_check_env_names_the_env_the_check_and_what_differed(broken, check, says) -> None:
    with pytest.raises(EnvCheckError) as caught:
        check_env(broken)
    error = caught.value
    assert (error.env, error.check) == ("guess()", check), str(error)
    assert str(error).startswith(f"guess(): check {check!r} failed: ")
    assert says in error.detail, str(error)


@pytest.mark.parametrize("turn_order", ["sequential", "simultaneous"])
@pytest.mark.parametrize("single_agent", [False, True], ids=["multi", "single"])
def test_a_good_env_passes_every_check(single_agent: bool, turn_order: str) -> None:
    check_env(functools.partial(GuessEnv, single_agent=single_agent, turn_order=turn_order))
    check_env(GuessEnv(single_agent=single_agent, turn_order=turn_order))  # rebuilt per check


def test_the_failure_names_the_options_and_checks_can_be_picked() -> None:
    with pytest.raises(EnvCheckError, match=re.escape("guess(single_agent=True): check 'seeds'")):
        check_env(ResetIgnoresSeed(single_agent=True), checks=["observations", "seeds"])
    check_env(ResetIgnoresSeed, checks=["snapshot/restore", "parallel_api_test"])
    with pytest.raises(ValueError, match="unknown check"):
        check_env(GuessEnv, checks=["snapshots"])
    assert list(CHECKS)[-2:] == ["parallel_api_test", "gymnasium"]


def test_a_registered_env_is_checked_by_name() -> None:
    check_env("say", checks=["turn order", "snapshot/restore"])


def test_the_docs_example_of_your_own_env_runs(tmp_path: Path) -> None:
    section = (DOCS / "envs.md").read_text().split("## Your own env", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "docs/envs.md's 'Your own env' has no python example"
    script = tmp_path / "my_env.py"
    script.write_text(blocks[0])  # the complete example; the later ones name your package
    namespace = runpy.run_path(str(script))  # the example calls check_env itself
    assert issubclass(namespace["GuessEnv"], MASEnv)


def test_an_env_built_with_strict_actions_passes_too() -> None:
    """parallel_api_test passes every agent's action: check_env runs it without strictness."""
    check_env(GuessEnv(strict_actions=True, max_rounds=6))
