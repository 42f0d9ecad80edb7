"""An environment written for OpenEnv as a masenvs env, so `masenvs train` trains a team on it
with AT-GRPO.

`OpenEnvEnv(url=...)` talks to any OpenEnv server (openenv-core's `create_app`, a Hugging Face
Space, `masenvs openenv-serve`) through the official client. The team is `team`: the last role
acts, its answer sent as the OpenEnv action (`{action_field: text}`, or the answer parsed as a
JSON object with `action_format: json`); the roles before it advise it, each seeing the
observation and what the roles before it said this round. The OpenEnv step reward is the team
reward, paid to every role at the step that earns it; an action the server refuses is an
invalid move (`invalid_penalty`). The episode ends when the OpenEnv env says done, solved when
its return reaches `success_at`.

Branching (AT-GRPO's K candidates per turn) needs the OpenEnv env to be deterministic for a
seed and the moves played: `restore` only changes local state, and a branch's own session is
brought to it by resetting with the task's seed and replaying the moves it lacks.

A config names it `openenv` (no import needed: the registry knows it): `env.name=openenv`,
`env.options={url: http://127.0.0.1:8000, team: [coach, player]}`. The server must allow
(rollout.branches + 1) x rollout.tasks_per_step concurrent sessions (`max_concurrent_envs`).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import weakref
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from openenv.core.generic_client import GenericEnvClient
from pydantic import Field

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts


class OpenEnvConfig(EnvConfig):
    url: str = Field(
        description="Base URL of the OpenEnv server (http://host:port; with a key, "
        "http://user:KEY@host:port)."
    )
    team: list[str] = Field(
        default_factory=lambda: ["player"],
        min_length=1,
        description="The roles in turn order: the last one acts in the OpenEnv env, the ones "
        "before it advise it.",
    )
    observation_field: str | None = Field(
        None,
        description="The observation field shown to the roles as text; None: every field, as JSON.",
    )
    action_field: str = Field("message", description="The action field the answer goes into.")
    action_format: Literal["text", "json"] = Field(
        "text",
        description="'text': the answer is sent as `{action_field: answer}`; 'json': the answer "
        "is a JSON object sent as the action (an answer that is not one is an invalid move).",
    )
    instructions: str = Field(
        "You act in an environment, one step at a time.",
        description="The system prompt's first line, before the role's part.",
    )
    invalid_penalty: float = Field(
        -1.0, description="Agent reward for an action the server refuses or that cannot be sent."
    )
    success_at: float = Field(
        1.0, description="The episode is solved when it ends with a return of at least this."
    )
    reset_options: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments of every OpenEnv reset."
    )
    timeout_s: float = Field(60.0, gt=0, description="Seconds one reset or step may take.")


# --- reward: the OpenEnv env's own, as the team's ------------------------------------------------


def step_reward(reward: float | None) -> RewardParts:
    """An OpenEnv step's reward is the team outcome of that step (None: nothing)."""
    return RewardParts(team=float(reward or 0.0))


# --- task and state ------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenEnvTask:
    seed: int  # the OpenEnv reset seed


@dataclass
class OpenEnvState(EpisodeState):
    seed: int = 0
    moves: list[dict[str, Any]] = field(default_factory=list)  # actions the OpenEnv env took
    observation: dict[str, Any] = field(default_factory=dict)
    last_reward: float | None = None
    returned: float = 0.0
    notes: list[tuple[str, str]] = field(default_factory=list)  # advisors' words this round


class OpenEnvEnv(MASEnv):
    name = "openenv"
    roles = ("player",)  # the default team; `team` sets an instance's roles
    solo_role = "player"
    config_class = OpenEnvConfig

    config: OpenEnvConfig
    task: OpenEnvTask
    state: OpenEnvState

    def __init__(self, config: EnvConfig | None = None, render_mode: str | None = None, **kw: Any):
        super().__init__(config, render_mode, **kw)
        team = list(dict.fromkeys(self.config.team))
        if len(team) != len(self.config.team):
            raise ValueError(f"openenv: team roles must differ, got {self.config.team}")
        self.roles = tuple(team)
        self.solo_role = team[-1]
        self.possible_agents = [team[-1]] if self.config.single_agent else team
        self._client: GenericEnvClient | None = None
        self._remote: tuple[int | None, list[dict[str, Any]]] = (None, [])  # what the server holds

    @property
    def actor(self) -> str:
        return self.possible_agents[-1]

    # --- task ------------------------------------------------------------------------------------

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, str], dict[str, dict[str, Any]]]:
        self._seed = seed  # the OpenEnv reset gets the same seed: task s is the server's task s
        return super().reset(seed=seed, options=options)

    def generate_task(self, rng: np.random.Generator) -> OpenEnvTask:
        seed = getattr(self, "_seed", None)
        return OpenEnvTask(int(rng.integers(0, 2**31 - 1)) if seed is None else seed)

    def load_task(self, task: Any) -> OpenEnvTask:
        if isinstance(task, OpenEnvTask):
            return task
        seed = task.get("seed") if isinstance(task, dict) else task
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"an openenv task is a seed or {{'seed': ...}}, got {task!r}")
        return OpenEnvTask(seed)

    def initial_state(self, task: OpenEnvTask) -> OpenEnvState:
        observation = self._reset_remote(task.seed)
        return OpenEnvState(seed=task.seed, observation=observation)

    def task_info(self) -> dict[str, Any]:
        return {"seed": self.task.seed}

    # --- prompt ----------------------------------------------------------------------------------

    def prompt(self, agent: str) -> list[Message]:
        cfg, state = self.config, self.state
        if agent == self.actor:
            part = f"You are the {agent}: your answer is sent to the environment as your action."
        else:
            part = (
                f"You are the {agent} of a team: the {self.actor}'s answer is sent to the "
                f"environment as its action; yours is shown to the roles after you."
            )
        if cfg.action_format == "json":
            part += " The action is a JSON object."
        observation = state.observation
        if cfg.observation_field is not None:
            text = str(observation.get(cfg.observation_field, ""))
        else:
            text = json.dumps(observation, ensure_ascii=False, sort_keys=True)
        lines = [f"Observation:\n{text}"]
        if state.last_reward is not None:
            lines.append(f"Reward of the last action: {state.last_reward:g}")
        lines += [f"The {role} says:\n{note}" for role, note in state.notes]
        if agent == self.actor and self.last_feedback.get(agent):
            lines.append(self.last_feedback[agent])  # its last action was refused
        return [
            {"role": "system", "content": f"{cfg.instructions} {part}"},
            {"role": "user", "content": "\n\n".join(lines)},
        ]

    # --- turn ------------------------------------------------------------------------------------

    def play_turn(self, agent: str, action: str) -> RewardParts:
        state = self.state
        if agent == self.agents[0]:
            state.notes = []  # a new round
        if agent != self.actor:
            state.notes.append((agent, action))
            self.last_feedback[agent] = ""
            return RewardParts()
        payload, why = self._payload(action)
        if payload is not None:
            try:
                result = self._step_remote(payload)
            except RefusedAction as exc:
                payload, why = None, str(exc)
        if payload is None:
            self.last_feedback[agent] = f"The environment refused the action: {why}"
            return RewardParts(agent=self.config.invalid_penalty)
        state.moves.append(payload)
        state.observation = result.observation
        state.last_reward = float(result.reward or 0.0)
        state.returned += state.last_reward
        self.last_feedback[agent] = ""
        if result.done:
            state.success = state.returned >= self.config.success_at
            state.failed = not state.success
        return step_reward(result.reward)

    def _payload(self, action: str) -> tuple[dict[str, Any] | None, str]:
        if self.config.action_format == "text":
            return {self.config.action_field: action}, ""
        try:
            value = json.loads(action)
        except ValueError:
            return None, "the answer is not JSON"
        if not isinstance(value, dict):
            return None, "the answer is not a JSON object"
        return value, ""

    def render_text(self) -> str:
        state = self.state
        return (
            f"openenv seed {state.seed}: {len(state.moves)} move(s), return "
            f"{state.returned:g}{', solved' if state.success else ''}"
        )

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            _close_soon(client)

    # --- the OpenEnv session ---------------------------------------------------------------------

    def _reset_remote(self, seed: int) -> dict[str, Any]:
        result = self._call(lambda c: c.reset(seed=seed, **self.config.reset_options))
        self._remote = (seed, [])
        return result.observation

    def _step_remote(self, payload: dict[str, Any]) -> Any:
        """Step the server's episode, first bringing it to this env's state (a restored
        branch's session may be elsewhere: reset with the seed, replay the moves it lacks).
        A dropped connection is retried once, on a new session replayed from the start."""
        for attempt in (0, 1):
            try:
                return self._sync_and_step(payload)
            except Dropped:
                if attempt:
                    raise
                self._remote = (None, [])

    def _sync_and_step(self, payload: dict[str, Any]) -> Any:
        state = self.state
        seed, done = self._remote
        if seed != state.seed or done != state.moves[: len(done)]:
            self._reset_remote(state.seed)
            done = []
        for move in state.moves[len(done) :]:
            self._call(lambda c, m=move: c.step(m))
            self._remote[1].append(move)
        result = self._call(lambda c: c.step(payload))
        self._remote[1].append(payload)
        return result

    def _call(self, request: Any) -> Any:
        """Run `request(client)` on the shared loop: a server error (a refused action) is a
        RefusedAction, a connection that fails is Dropped (and closed)."""
        fresh = self._client is None
        if self._client is None:
            self._client = GenericEnvClient(
                base_url=self.config.url, message_timeout_s=self.config.timeout_s
            )
            weakref.finalize(self, _close_soon, self._client)
        try:
            if fresh:
                _run(_connect(self._client), self.config.timeout_s + 10)
            return _run(request(self._client), self.config.timeout_s + 10)
        except RuntimeError as exc:
            if str(exc).startswith("Server error:"):
                raise RefusedAction(str(exc).removeprefix("Server error: ")) from None
            raise
        except (OSError, _closed_errors()) as exc:  # ConnectionError and TimeoutError too
            self.close()
            raise Dropped(
                f"openenv: the OpenEnv server at {_public(self.config.url)} did not answer "
                f"({type(exc).__name__}: {exc}); is it running, and does it allow enough "
                "concurrent sessions (max_concurrent_envs)?"
            ) from None


class Dropped(ConnectionError):
    """The connection to the OpenEnv server failed or closed."""


def _public(url: str) -> str:
    """`url` without a key in it (http://user:KEY@host -> http://host)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{scheme}{sep}{netloc.rpartition('@')[2]}{slash}{path}"


class RefusedAction(ValueError):
    """The OpenEnv server answered a step with an error (the action failed its schema)."""


def _closed_errors() -> type[Exception]:
    from websockets.exceptions import ConnectionClosed

    return ConnectionClosed


# --- one event loop for every OpenEnv connection of the process -----------------------------------

_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0
_loop_lock = threading.Lock()


def _shared_loop() -> asyncio.AbstractEventLoop:
    """A daemon thread's event loop (one per process, started again after a fork)."""
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():
            global _connecting
            _connecting = None  # a lock belongs to its loop
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="openenv-clients", daemon=True).start()
            _loop, _loop_pid = loop, os.getpid()
        return _loop


_connecting: asyncio.Lock | None = None  # of the shared loop, made on it


async def _connect(client: GenericEnvClient) -> None:
    """Connect one client at a time: openenv-core's connect sets NO_PROXY in os.environ for
    a loopback URL and puts back what it found afterwards, so two connects interleaved on the
    loop leave it set for good (every later child process, and libraries that read proxies,
    see it)."""
    global _connecting
    if _connecting is None:
        _connecting = asyncio.Lock()
    async with _connecting:
        await client.connect()


def _run(coroutine: Coroutine[Any, Any, Any], timeout: float) -> Any:
    return asyncio.run_coroutine_threadsafe(coroutine, _shared_loop()).result(timeout)


def _close_soon(client: GenericEnvClient) -> None:
    """Close a connection without waiting (also from a finalizer)."""
    if _loop is not None and _loop_pid == os.getpid() and not _loop.is_closed():
        asyncio.run_coroutine_threadsafe(client.close(), _loop)
