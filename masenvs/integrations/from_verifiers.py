"""A taskset written for verifiers (0.4, `verifiers.v1`) as a masenvs env, so `masenvs train`
trains it as a role with AT-GRPO.

`VerifiersEnv(taskset="my-taskset")` loads the taskset as vf-eval does (by id, with
`taskset_options` as its config). A task is one of its rows: the role `solver` sees the row's
system prompt and prompt, answers, and the row's own rubric (its `@vf.reward` functions) scores
the answer on a verifiers trace of that exchange; the weighted sum (verifiers' `trace.reward`)
is the team reward, paid when the episode ends, and the task is solved at `success_at`. With
`max_rounds > 1` a short answer gets its score back and tries again. The row's other fields
(answers, tests) reach only the rubric. Rewards that need a runtime (a sandbox) and LLM judges
cannot score here: such a taskset is refused when the env is built.

A train config names it `verifiers` (the registry knows it; no import needed):
`env.name=verifiers`, `env.options={taskset: my-taskset}`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import Field

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts

if TYPE_CHECKING:  # imported where used: verifiers lives in a venv of its own
    import verifiers.v1 as vf


class VerifiersConfig(EnvConfig):
    taskset: str = Field(
        description="A verifiers taskset id: an installed module exporting a vf.Taskset."
    )
    taskset_options: dict[str, Any] = Field(
        default_factory=dict, description="The taskset's config fields (`--env.taskset.*`)."
    )
    max_tasks: int = Field(
        10_000, ge=1, description="Rows read from the taskset (an infinite one is cut here)."
    )
    success_at: float = Field(1.0, description="A reward at least this solves the task.")
    max_rounds: int = Field(1, ge=1, le=1000, description="Attempts before the episode ends.")


# --- reward: the taskset's own rubric on a verifiers trace of the exchange -----------------------


def rubric_reward(task: vf.Task, messages: list[Message], answer: str) -> float:
    """verifiers' `trace.reward` for `answer` to `messages`: the task's rewards, weighted."""
    import verifiers.v1 as vf
    from verifiers.v1.dialects import parse_message
    from verifiers.v1.errors import TaskError
    from verifiers.v1.state import state_cls

    nodes: list[vf.MessageNode] = []
    for message in [*messages, {"role": "assistant", "content": answer}]:
        nodes.append(
            vf.MessageNode(
                parent=len(nodes) - 1 if nodes else None,
                message=parse_message(message),
                sampled=len(nodes) == len(messages),  # the answer; earlier ones are context
            )
        )
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        nodes=nodes,
        state=state_cls(type(task))(),
    )
    try:
        run_sync(task.score(trace))
    except TaskError:  # a rubric that chokes on the answer: an invalid move, paid nothing
        return 0.0
    return float(trace.reward)


def run_sync(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine from sync code, also when the caller is inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def offline_problems(task: vf.Task) -> list[str]:
    """What of the task's scoring needs more than the transcript (a runtime, an LLM judge)."""
    problems = [
        f"reward {fn.__name__!r} needs a runtime"
        for fn in task.hooks("reward")
        if (p := inspect.signature(fn).parameters.get("runtime")) is not None
        and p.default is inspect.Parameter.empty
    ]
    return problems + [f"judge {j.id!r} needs a model" for j in task.config.judges]


# --- task ------------------------------------------------------------------------------------------


def load_rows(config: VerifiersConfig) -> list[vf.Task]:
    try:
        from verifiers.v1.utils.loaders import load_taskset, taskset_config_type
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"the {VerifiersEnv.name} env needs verifiers 0.4 ({exc}): install "
            "'masenvs[verifiers]' in a venv of its own (scripts/verifiers_env.sh builds one)"
        ) from None

    options = {**config.taskset_options, "id": config.taskset}
    taskset = load_taskset(taskset_config_type(config.taskset).model_validate(options))
    rows = list(taskset.take(config.max_tasks))
    if not rows:
        raise ValueError(f"verifiers taskset {config.taskset!r} yielded no tasks")
    problems = offline_problems(rows[0])
    if problems:
        raise ValueError(
            f"verifiers taskset {config.taskset!r} cannot score from the transcript alone: "
            + "; ".join(problems)
        )
    return rows


def prompt_messages(task: vf.Task) -> list[Message]:
    """The row's system prompt and prompt as chat messages (text only)."""
    from verifiers.v1.types import content_text

    data = task.data
    messages: list[Message] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        for message in data.prompt or []:
            messages.append({"role": message.role, "content": content_text(message.content)})
    return messages


@dataclass
class VerifiersState(EpisodeState):
    attempts: list[tuple[str, float]] = field(default_factory=list)  # (answer, reward)


class VerifiersEnv(MASEnv):
    name = "verifiers"
    roles = ("solver",)
    solo_role = "solver"
    config_class = VerifiersConfig

    def __init__(self, config: EnvConfig | None = None, render_mode: str | None = None, **kw: Any):
        super().__init__(config, render_mode, **kw)
        self.rows = load_rows(self.config)

    def generate_task(self, rng: np.random.Generator) -> int:
        return int(rng.integers(len(self.rows)))

    def load_task(self, task: Any) -> int:
        if not isinstance(task, int) or not 0 <= task < len(self.rows):
            raise ValueError(f"a {self.name} task is a row index in [0, {len(self.rows)})")
        return task

    def initial_state(self, task: int) -> VerifiersState:
        return VerifiersState()

    def prompt(self, agent: str) -> list[Message]:
        messages = prompt_messages(self.rows[self.task])
        for answer, reward in self.state.attempts:
            messages.append({"role": "assistant", "content": answer})
            messages.append(
                {"role": "user", "content": f"That answer scored {reward:g}. Try again."}
            )
        return messages

    def play_turn(self, agent: str, action: str) -> RewardParts:
        task = self.rows[self.task]
        reward = rubric_reward(task, self.prompt(agent), action)
        self.state.attempts.append((action, reward))
        self.state.success = reward >= self.config.success_at
        self.last_feedback[agent] = f"scored {reward:g}"
        last = self.state.success or self.round + 1 >= self.config.max_rounds
        return RewardParts(team=reward if last else 0.0)

    def task_info(self) -> dict[str, Any]:
        data = self.rows[self.task].data if self.task is not None else None
        return {"index": self.task, "name": data.name if data else None}

    def render_text(self) -> str:
        scores = [f"{r:g}" for _, r in (self.state.attempts if self.state else [])]
        return f"{self.name}:{self.config.taskset} task {self.task} scores {scores}"
