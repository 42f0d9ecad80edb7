"""The environment contract every masenvs task follows.

A `MASEnv` is a PettingZoo `ParallelEnv` whose agents are roles. A round (the paper's turn)
is one `step` per agent, in the env's turn order (`roles`): `env.acting` names the agent whose
action the next step plays, and the actions of the others are ignored, as in PettingZoo's own
turn-based parallel envs. With `turn_order="sequential"` (the default, as in Stronger-MAS) a
later agent's observation shows what earlier agents did this round; with "simultaneous" every
agent sees the round as it stood when the round began.
Subclasses supply the task: `generate_task`, `prompt`, `play_turn`, `render_text`.
"""

from __future__ import annotations

import copy
import dataclasses
import string
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv
from pydantic import BaseModel, ConfigDict, Field, ValidationError

Message = dict[str, str]

MAX_TEXT = 1 << 20  # one MiB of text per observation or action

# What `Text.sample()` draws from; `contains` accepts any unicode string (see FullText).
_SAMPLE_CHARSET = string.printable + "äöüßéèçñ€→←↑↓✓✗αβγ中文日本語한국어😀"


class FullText(spaces.Text):
    """A text space over the whole of unicode.

    gymnasium's `Text` checks membership against a finite charset; model output can hold any
    character, so membership here is any `str` within the length bounds.
    """

    def __init__(self, max_length: int = MAX_TEXT) -> None:
        super().__init__(max_length=max_length, min_length=0, charset=_SAMPLE_CHARSET)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        # Short samples keep fuzzing and API tests fast; long text is fuzzed separately.
        length = int(self.np_random.integers(0, 64))
        chars = self.np_random.choice(list(_SAMPLE_CHARSET), size=length)
        return "".join(chars)

    def __repr__(self) -> str:
        return f"FullText(max_length={self.max_length})"


@dataclass
class RewardParts:
    """One agent's reward for one round, by level (DESIGN.md: process, agent, team)."""

    process: float = 0.0  # shaping for progress made by this agent's own action
    agent: float = 0.0  # this agent's own outcome: its answer right or wrong, invalid move
    team: float = 0.0  # the team's outcome, shared by every agent at the step that decides it

    def total(self, weights: RewardWeights) -> float:
        return (
            weights.process * self.process + weights.agent * self.agent + weights.team * self.team
        )


class RewardWeights(BaseModel):
    """How the three reward levels combine into `rewards[agent]`."""

    model_config = ConfigDict(extra="forbid")
    process: float = Field(1.0, description="Weight of the process (shaping) reward.")
    agent: float = Field(1.0, description="Weight of the agent's own outcome.")
    team: float = Field(1.0, description="Weight of the team outcome (alpha in the paper).")


class EnvConfigError(ValueError):
    """An env option that does not exist or has a bad value: one line naming it and the fix."""


def explain_config_error(env: str, config_class: type[BaseModel], exc: ValidationError) -> str:
    """Pydantic's multi-line report (with its URLs) as one line per option, did-you-mean
    included: `sudoku: unknown option 'sizee' (did you mean 'size'?)`."""
    import difflib

    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(options)"
        if err["type"] == "extra_forbidden":
            names = list(config_class.model_fields)
            close = difflib.get_close_matches(str(err["loc"][-1]), names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"options: {', '.join(names)}"
            parts.append(f"unknown option {where!r} ({hint})")
        else:
            shown = repr(err.get("input"))
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            parts.append(f"option {where}={shown}: {err['msg']}")
    return f"{env}: " + "; ".join(parts)


def build_config(env: str, config_class: type[EnvConfig], options: dict[str, Any]) -> EnvConfig:
    """`config_class(**options)`, or an `EnvConfigError` naming the bad option in one line."""
    try:
        return config_class(**options)
    except ValidationError as exc:
        raise EnvConfigError(explain_config_error(env, config_class, exc)) from None


class EnvConfig(BaseModel):
    """Settings every environment has; each env extends it with its own fields."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    max_rounds: int = Field(4, ge=1, le=1000, description="Rounds before the episode truncates.")
    single_agent: bool = Field(
        False, description="One role does the whole task (the paper's single-agent baseline)."
    )
    reward_weights: RewardWeights = Field(default_factory=RewardWeights)
    max_action_chars: int = Field(
        65536, ge=1, description="Longer actions are cut to this many characters before parsing."
    )
    strict_actions: bool = Field(
        False,
        description="step() fails (ValueError) on actions for agents other than env.acting; "
        "False: they are ignored, with a warning the first time.",
    )
    turn_order: Literal["sequential", "simultaneous"] = Field(
        "sequential",
        description="'sequential' (Stronger-MAS): agents act one after another in the env's "
        "role order and a later agent sees what earlier agents did this round. "
        "'simultaneous': every agent answers the round as it stood when the round began and "
        "sees the others' actions only next round.",
    )


@dataclass
class Snapshot:
    """Everything needed to branch an episode: restore it any number of times."""

    env_name: str
    state: Any
    task: Any
    round: int
    turn: int  # index in `agents` of the agent due to act
    agents: list[str]
    last_actions: dict[str, str]
    last_feedback: dict[str, str]
    rng_state: dict[str, Any]
    round_prompts: dict[str, list[Message]]


@dataclass
class EpisodeState:
    """Base of each env's mutable state; the base class reads `success` and `failed`."""

    success: bool = False
    failed: bool = False  # ends the episode without success (e.g. a deadlocked sokoban)


class IgnoredActionsWarning(UserWarning):
    """step() got actions for agents whose turn it is not; only env.acting's was played."""


_WARNED_IGNORED: set[type] = set()


class MASEnv(ParallelEnv):
    """Base class of all masenvs environments."""

    name: ClassVar[str] = "base"
    roles: ClassVar[tuple[str, ...]] = ()  # roles in multi-agent mode, in the paper's turn order
    solo_role: ClassVar[str] = ""  # the one role in single-agent mode
    config_class: ClassVar[type[EnvConfig]] = EnvConfig
    grid_render: ClassVar[bool] = False  # grid tasks also render "rgb_array"
    # Completion tokens per call when a rollout does not say (`masenvs rollout`): enough for
    # a good answer, so a small model's chatter does not run every call to the limit.
    answer_tokens: ClassVar[int] = 256

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "is_parallelizable": True}

    def __init__(
        self, config: EnvConfig | None = None, render_mode: str | None = None, **overrides: Any
    ) -> None:
        if config is None:
            config = build_config(self.name, self.config_class, overrides)
        elif overrides:
            config = build_config(
                self.name, self.config_class, {**config.model_dump(), **overrides}
            )
        if not isinstance(config, self.config_class):
            raise TypeError(
                f"{self.name} needs a {self.config_class.__name__}, got {type(config).__name__}"
            )
        modes = self.render_modes()
        if render_mode is not None and render_mode not in modes:
            raise ValueError(f"render_mode must be one of {modes}, got {render_mode!r}")
        self.config = config
        self.render_mode = render_mode
        self.metadata = {**type(self).metadata, "render_modes": modes, "name": self.name}
        self.possible_agents = [self.solo_role] if config.single_agent else list(self.roles)
        self.agents: list[str] = []
        self._space = FullText()
        self.task: Any = None
        self.state: Any = None
        self.round = 0
        self.turn = 0  # index in `agents` of the agent due to act
        self.last_actions: dict[str, str] = {}  # each agent's latest raw action
        self.last_feedback: dict[str, str] = {}  # each agent's latest feedback
        # Simultaneous turns: the prompts as the round began, shown all round long.
        self._round_prompts: dict[str, list[Message]] = {}
        self._rng = np.random.default_rng()

    @classmethod
    def render_modes(cls) -> list[str]:
        return ["ansi", "rgb_array"] if cls.grid_render else ["ansi"]

    # --- what each task defines -------------------------------------------------------------

    def generate_task(self, rng: np.random.Generator) -> Any:
        """A new task drawn from `rng` (deterministic for a given generator state)."""
        raise NotImplementedError(f"{type(self).__name__} must define generate_task")

    def load_task(self, task: Any) -> Any:
        """Accept a task passed by `reset(options={"task": ...})`: the env's type or a dict."""
        return task

    def initial_state(self, task: Any) -> EpisodeState:
        return EpisodeState()

    def prompt(self, agent: str) -> list[Message]:
        """The chat messages `agent` sees now."""
        raise NotImplementedError(f"{type(self).__name__} must define prompt")

    def play_turn(self, agent: str, action: str) -> RewardParts:
        """Apply `agent`'s action to `self.state`; return its reward parts.

        `team` is the team outcome this action decides (0 when it commits nothing); every
        agent receives it. Must also set `self.last_feedback[agent]`, what `agent` sees next.
        """
        raise NotImplementedError(f"{type(self).__name__} must define play_turn")

    def render_text(self) -> str:
        return f"{self.name} round {self.round}"

    def render_rgb(self) -> np.ndarray:
        raise ValueError(f"{self.name} has no rgb_array rendering")

    @property
    def callers(self) -> list[str]:
        """Agents that act inside a step through the capture endpoint (auto-MAS's executor)
        rather than through `step`; the trainer serves and trains them as well."""
        return []

    def task_info(self) -> dict[str, Any]:
        """JSON-friendly facts about the task for `infos` (ids, sizes, optimal lengths)."""
        return {}

    def answer_action(self, answer: str) -> str:
        """The action that gives `answer`, read bare from a program's own state (a LangGraph
        `answer_from` key), in the format this env parses: math boxes it, code fences it."""
        return answer

    def episode_metrics(self) -> dict[str, float]:
        """Rates reported beside success, each 0 or 1 for the episode so far (plan-path:
        `optimal`, `exact_stop`); in `infos[agent]["metrics"]`, and averaged over episodes by
        the trainer (`train/<name>`, `val/<name>`) and `masenvs eval`."""
        return {}

    # --- PettingZoo API ---------------------------------------------------------------------

    def observation_space(self, agent: str) -> spaces.Space:
        return self._space

    def action_space(self, agent: str) -> spaces.Space:
        return self._space

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
        self._rng = np.random.default_rng(seed)
        if seed is not None:
            self._space.seed(seed)
        options = options or {}
        task = options.get("task")
        self.task = self.load_task(task) if task is not None else self.generate_task(self._rng)
        self.state = self.initial_state(self.task)
        self.round = 0
        self.turn = 0
        self.agents = list(self.possible_agents)
        self.last_actions = {}
        self.last_feedback = {}
        self._begin_round()
        observations = {agent: self.observe(agent) for agent in self.agents}
        infos = {agent: self._info(agent, None) for agent in self.agents}
        return observations, infos

    @property
    def acting(self) -> str | None:
        """The agent whose action the next `step` plays (None once the episode is over)."""
        return self.agents[self.turn] if self.agents else None

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        """Play the acting agent's action (others' are ignored); every live agent gets the
        team reward this action decides, the acting agent its own parts too."""
        if not self.agents:
            raise RuntimeError("step() called on a finished episode: call reset() first")
        agent = self.agents[self.turn]
        if actions and agent not in actions:  # a caller that lost track of the turn order
            raise ValueError(
                f"it is {agent}'s turn but step() got actions only for {sorted(actions)}: "
                "pass env.acting's action (the others are ignored)"
            )
        ignored = sorted(a for a in actions if a != agent)
        if ignored:
            self._ignored_actions(agent, ignored)
        action = self._clean_action(actions.get(agent))
        own = self.play_turn(agent, action)
        self.last_actions[agent] = action
        parts = {a: RewardParts(team=own.team) for a in self.agents}
        parts[agent] = own

        self.turn += 1
        if self.turn == len(self.agents):  # the round is complete
            self.round += 1
            self.turn = 0
        done = bool(self.state.success or self.state.failed)
        truncated = not done and self.turn == 0 and self.round >= self.config.max_rounds
        live = list(self.agents)
        weights = self.config.reward_weights
        rewards = {a: float(parts[a].total(weights)) for a in live}
        terminations = dict.fromkeys(live, done)
        truncations = dict.fromkeys(live, truncated)
        if done or truncated:
            self.agents = []
            self._round_prompts = {}  # the final observation shows the final state
        elif self.turn == 0:
            self._begin_round()
        observations = {a: self.observe(a) for a in live}
        infos = {a: self._info(a, parts[a]) for a in live}
        if self.render_mode == "ansi":
            print(self.render_text())
        return observations, rewards, terminations, truncations, infos

    def render(self) -> str | np.ndarray | None:
        if self.render_mode == "rgb_array":
            return self.render_rgb()
        if self.render_mode == "ansi":
            return self.render_text()
        return None

    def close(self) -> None:
        pass

    # --- branching --------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """Capture the episode so `restore` can branch from here (the trainer's tree sampling)."""
        return Snapshot(
            env_name=self.name,
            state=copy.deepcopy(self.state),
            task=self.task,  # tasks are never mutated, so sharing them is safe
            round=self.round,
            turn=self.turn,
            agents=list(self.agents),
            last_actions=dict(self.last_actions),
            last_feedback=dict(self.last_feedback),
            rng_state=copy.deepcopy(self._rng.bit_generator.state),
            round_prompts=dict(self._round_prompts),  # never mutated, only replaced
        )

    def restore(self, snapshot: Snapshot) -> None:
        if snapshot.env_name != self.name:
            raise ValueError(f"snapshot of {snapshot.env_name!r} cannot restore {self.name!r}")
        self.state = copy.deepcopy(snapshot.state)
        self.task = snapshot.task
        self.round = snapshot.round
        self.turn = snapshot.turn
        self.agents = list(snapshot.agents)
        self.last_actions = dict(snapshot.last_actions)
        self.last_feedback = dict(snapshot.last_feedback)
        self._rng.bit_generator.state = copy.deepcopy(snapshot.rng_state)
        self._round_prompts = dict(snapshot.round_prompts)

    # --- helpers ----------------------------------------------------------------------------

    def messages(self, agent: str) -> list[Message]:
        """What `agent` sees now: its live prompt, or in simultaneous mode the round's start."""
        if self.config.turn_order == "simultaneous" and agent in self._round_prompts:
            return [dict(m) for m in self._round_prompts[agent]]  # callers may edit theirs
        return self.prompt(agent)

    def observe(self, agent: str) -> str:
        return messages_to_text(self.messages(agent))

    def _begin_round(self) -> None:
        if self.config.turn_order == "simultaneous":
            self._round_prompts = {agent: self.prompt(agent) for agent in self.agents}

    def _ignored_actions(self, agent: str, ignored: list[str]) -> None:
        """The PettingZoo loop `env.step({a: ... for a in env.agents})` plays only the acting
        agent's action: say so once per env class (or fail, with `strict_actions`)."""
        message = (
            f"{self.name}: step() plays only env.acting's action ({agent!r}) and ignored the "
            f"actions of {', '.join(map(repr, ignored))}: agents take turns, so pass "
            "{env.acting: action}, or loop `while env.agents: env.step({env.acting: ...})`"
        )
        if self.config.strict_actions:
            raise ValueError(message + " (strict_actions)")
        if type(self) not in _WARNED_IGNORED:
            _WARNED_IGNORED.add(type(self))
            warnings.warn(
                message + "; warned once (strict_actions=True makes it an error)",
                IgnoredActionsWarning,
                stacklevel=3,
            )

    def _clean_action(self, action: Any) -> str:
        if action is None:
            return ""
        if isinstance(action, bytes):
            action = action.decode("utf-8", errors="replace")
        elif not isinstance(action, str):
            action = str(action)
        # Lone surrogates cannot be encoded for a tokenizer or a JSON trace.
        action = action.encode("utf-8", errors="replace").decode("utf-8")
        return action[: self.config.max_action_chars]

    def _info(self, agent: str, parts: RewardParts | None) -> dict[str, Any]:
        info: dict[str, Any] = {
            "messages": self.messages(agent),
            "round": self.round,
            "success": bool(self.state.success),
            "task": self.task_info(),
        }
        if parts is not None:
            info["reward_parts"] = dataclasses.asdict(parts)
        metrics = self.episode_metrics()
        if metrics:
            info["metrics"] = metrics
        return info


def messages_to_text(messages: list[Message]) -> str:
    """The observation string: every message's content, in order."""
    return "\n\n".join(m["content"] for m in messages)


@dataclass
class RoundLog:
    """One line of an episode's history, kept for prompts that show earlier rounds."""

    round: int
    agent: str
    action: str
    feedback: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def play_round(
    env: MASEnv, actions: dict[str, str]
) -> tuple[dict, dict[str, float], dict, dict, dict]:
    """Play the rest of the current round with fixed actions, each at its agent's turn.

    Returns the last step's results with rewards and `reward_parts` summed over the round's
    steps: a scripted round in one call (tests, benchmarks, replays of logged actions).
    """
    if not env.agents:
        raise RuntimeError("play_round() called on a finished episode: call reset() first")
    start = env.round
    totals = {agent: RewardParts() for agent in env.agents}
    while True:
        agent = env.acting
        obs, _, terms, truncs, infos = env.step(
            {agent: actions[agent]} if agent in actions else actions
        )
        for agent, info in infos.items():
            for level, value in info["reward_parts"].items():
                setattr(totals[agent], level, getattr(totals[agent], level) + value)
        if not env.agents or env.round != start:
            break
    weights = env.config.reward_weights
    rewards = {agent: float(totals[agent].total(weights)) for agent in infos}
    for agent, info in infos.items():
        info["reward_parts"] = dataclasses.asdict(totals[agent])
    return obs, rewards, terms, truncs, infos
