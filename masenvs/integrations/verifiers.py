"""Every masenvs env as a verifiers (0.4, `verifiers.v1`) environment: vf-eval, prime-rl.

verifiers finds an environment by its taskset id, the name of an importable module that
exports a `vf.Taskset` (and here its `vf.Env` and `vf.Harness` too). Ours is `masenvs-verifiers`
(module `masenvs_verifiers`): importing this module makes the id resolvable, and
`python -m masenvs.integrations.verifiers ARGS` is `vf-eval ARGS` with it resolvable.

One verifiers task is one masenvs episode: env, options, seed and, to train one role, `role`.
`MasenvsEnv.run` plays it as a `TextEpisode` (episode.py): the seat `player` answers the acting
role's prompt exactly as the env renders it, one model call a step through verifiers'
interception (so the trace has the tokens); with `role`, the other roles are played by the
fixed player at `others.base_url`. The trace's reward `masenvs` is the env's return for the
policy (every role's summed, or the trained role's), its parts are metrics, and
`trace.info["masenvs"]` holds every role's actions in order, so a replay gives the same numbers.
A task row holds which episode to play, never its answer: no hidden tests, no solutions.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from collections.abc import Iterator
from typing import Any

from pydantic import Field, model_validator

from masenvs.env import build_config
from masenvs.integrations.episode import TextEpisode, openai_player
from masenvs.listeners import API_KEY_ENV
from masenvs.registry import UnknownEnvError, env_class

TASKSET_ID = "masenvs-verifiers"
REWARD = "masenvs"  # the trace reward holding the env's return

# What verifiers reads from a taskset module. The classes are built on first access
# (`plugin()`), so this module imports where verifiers is not installed: verifiers lives in a
# venv of its own (scripts/verifiers_env.sh), and the masenvs core imports no optional extra.
PLUGIN = (
    "MasenvsData",
    "MasenvsEnv",
    "MasenvsEnvConfig",
    "MasenvsHarness",
    "MasenvsHarnessConfig",
    "MasenvsTask",
    "MasenvsTaskset",
    "MasenvsTasksetConfig",
    "OthersConfig",
)
__all__ = list(PLUGIN)  # not a literal: the names exist once `plugin()` built them


def __getattr__(name: str) -> Any:
    if name in PLUGIN:
        return plugin()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def env_roles(name: str, options: dict[str, Any]) -> list[str]:
    """The env's roles under `options`, or the env's own one-line error (no task data loads)."""
    try:
        cls = env_class(name)
    except UnknownEnvError as exc:  # a KeyError; pydantic reports ValueErrors as config errors
        raise ValueError(str(exc)) from None
    config = build_config(cls.name, cls.config_class, options)
    return [cls.solo_role] if config.single_agent else list(cls.roles)


def reply(segment: Any) -> str:
    """The policy's answer as the model wrote it (`last_reply` strips it; the env must not)."""
    for message in reversed(segment.messages):
        if message.role == "assistant":
            return message.content if isinstance(message.content, str) else segment.last_reply
    return segment.last_reply


async def chat(ctx: Any, endpoint: str, secret: str, messages: list[dict]) -> Any:
    """One chat completion through verifiers' interception (it sets the model's sampling)."""
    import verifiers.v1 as vf
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
        await client.chat.completions.create(model=ctx.model, messages=messages)
    return vf.ProgramResult(exit_code=0, stdout="", stderr="")


@functools.cache
def plugin() -> dict[str, type]:
    """The taskset, env and harness classes verifiers loads (verifiers is imported here)."""
    import verifiers.v1 as vf
    from verifiers.v1.dialects.chat import message_to_wire

    classes = _taskset_classes(vf)
    classes |= _env_classes(vf, classes["MasenvsTasksetConfig"], classes["MasenvsTask"])
    classes |= _harness_classes(vf, message_to_wire)
    return classes


def _taskset_classes(vf: Any) -> dict[str, type]:
    """The taskset: which episodes to play."""

    class MasenvsTasksetConfig(vf.TasksetConfig):
        """`--env.taskset.*`: the masenvs env, its options, the seeds, and the role to train."""

        env: str = "plan_path"
        """A registered masenvs env (`masenvs list`)."""
        options: dict[str, Any] = Field(default_factory=dict)
        """Its options, as `masenvs.make(env, **options)` takes them."""
        role: str | None = None
        """Train this role only (the others are played by `--env.others.*`); None: every role."""
        seed: int = 0
        """Task i is the env's episode `reset(seed=seed + i)`."""
        num_tasks: int = Field(1000, ge=1)

        @model_validator(mode="after")
        def _check_env(self) -> MasenvsTasksetConfig:
            roles = env_roles(self.env, self.options)
            if self.role is not None and self.role not in roles:
                raise ValueError(f"{self.env} has roles {roles}; {self.role!r} is not one of them")
            return self

    class MasenvsData(vf.TaskData):
        env: str
        options: dict[str, Any]
        seed: int
        role: str | None = None

    class MasenvsTask(vf.Task[MasenvsData, vf.State, vf.TaskConfig]):
        """Scored by the env itself as the episode is played (`MasenvsEnv.run`)."""

    class MasenvsTaskset(vf.Taskset[MasenvsTask, MasenvsTasksetConfig]):
        def load(self) -> Iterator[MasenvsTask]:
            config = self.config
            for i in range(config.num_tasks):
                seed = config.seed + i
                yield MasenvsTask(
                    MasenvsData(
                        name=f"{config.env}#{seed}",
                        env=config.env,
                        options=dict(config.options),
                        seed=seed,
                        role=config.role,
                    ),
                    config.task,
                )

    return {name: value for name, value in locals().items() if name in PLUGIN}


def _env_classes(
    vf: Any,
    MasenvsTasksetConfig: type,
    MasenvsTask: type,  # named as the classes they are
) -> dict[str, type]:
    """The env: one masenvs episode per rollout."""

    class OthersConfig(vf.BaseConfig):
        """`--env.others.*`: the fixed player of the roles that are not trained."""

        base_url: str
        """An OpenAI-compatible server (e.g. `masenvs serve`), `.../v1`."""
        model: str | None = None
        """The model to ask; None: each role's name, as `masenvs serve` routes agents."""
        api_key_var: str = API_KEY_ENV
        """The environment variable holding its API key (unset: none is sent)."""
        temperature: float = 0.0
        max_tokens: int = Field(256, ge=1)

    class MasenvsEnvConfig(vf.EnvConfig):
        player: vf.AgentConfig = vf.AgentConfig(runtime=vf.SubprocessConfig())
        """The policy's seat: every role, or `taskset.role` (model calls only, no code runs)."""
        others: OthersConfig | None = None

        @model_validator(mode="after")
        def _check_others(self) -> MasenvsEnvConfig:
            taskset = self.taskset
            if isinstance(taskset, MasenvsTasksetConfig) and taskset.role and self.others is None:
                rest = [r for r in env_roles(taskset.env, taskset.options) if r != taskset.role]
                if rest:
                    raise ValueError(
                        f"training only {taskset.role!r} of {taskset.env} needs a player for "
                        f"{rest}: set --env.others.base_url (an OpenAI-compatible server)"
                    )
            return self

    class MasenvsEnv(vf.Env[MasenvsEnvConfig]):
        async def run(self, task: MasenvsTask, agents: vf.Agents) -> None:
            data = task.data
            episode = await asyncio.to_thread(
                TextEpisode, data.env, data.options, data.role, self._others()
            )
            turn = await asyncio.to_thread(episode.reset, data.seed)
            async with agents.player.interaction(task) as interaction:
                segment = await interaction.turn(turn.messages)
                while not segment.terminated:
                    result = await asyncio.to_thread(episode.step, reply(segment))
                    if result.next is None:
                        break
                    segment = await interaction.turn(result.next.messages)
            trace = interaction.trace
            trace.record_reward(REWARD, episode.reward)
            trace.record_metric("success", float(episode.success))
            trace.record_metric("steps", float(episode.steps))
            for level, value in episode.reward_parts.items():
                trace.record_metric(f"reward/{level}", value)
            for role, value in episode.returns.items():
                trace.record_metric(f"return/{role}", value)
            trace.info["masenvs"] = {
                "actions": [list(a) for a in episode.actions],
                "returns": dict(episode.returns),
                "success": episode.success,
                "done": episode.done,
            }

        def _others(self) -> Any:
            others = self.config.others
            if others is None:
                return None
            return openai_player(
                others.base_url,
                model=others.model,
                api_key=os.environ.get(others.api_key_var),
                temperature=others.temperature,
                max_tokens=others.max_tokens,
            )

    return {name: value for name, value in locals().items() if name in PLUGIN}


def _harness_classes(vf: Any, message_to_wire: Any) -> dict[str, type]:
    """The harness: one chat call per turn, the env's prompt as it is."""

    class MasenvsHarnessConfig(vf.HarnessConfig):
        pass

    class MasenvsHarness(vf.Harness[MasenvsHarnessConfig]):
        """Each turn is one chat completion on exactly the messages the env rendered for the acting
        role (masenvs prompts carry their own history), sent through verifiers' interception; it
        runs in-process and runs no code."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(
            self,
            ctx: vf.ModelContext,
            trace: vf.Trace,
            runtime: vf.Runtime,
            endpoint: str,
            secret: str,
            mcp_urls: dict[str, str],
            data: vf.TaskData,
            tool_interception_url: str | None = None,
        ) -> vf.ProgramResult:
            """A task that opens with its own prompt (ours open with the env's first turn)."""
            system, prompt = self.resolve_prompt(data)
            if prompt is None:
                raise vf.HarnessError("a masenvs turn needs the env's prompt; none was given")
            messages = (
                [{"role": "user", "content": prompt}]
                if isinstance(prompt, str)
                else [message_to_wire(m) for m in prompt]
            )
            if system:
                messages = [{"role": "system", "content": system}, *messages]
            return await chat(ctx, endpoint, secret, messages)

        async def resume(
            self,
            ctx: vf.ModelContext,
            trace: vf.Trace,
            runtime: vf.Runtime,
            endpoint: str,
            secret: str,
            mcp_urls: dict[str, str],
            data: vf.TaskData,
            messages: vf.Messages,
            tool_interception_url: str | None = None,
        ) -> vf.ProgramResult:
            """The env's turn: exactly the messages it rendered, not the conversation so far."""
            return await chat(ctx, endpoint, secret, [message_to_wire(m) for m in messages])

    return {name: value for name, value in locals().items() if name in PLUGIN}


def main(argv: list[str] | None = None) -> None:
    """`vf-eval`, with `masenvs-verifiers` resolvable."""
    from verifiers.v1.cli.eval.main import main as vf_eval

    vf_eval(argv)


if __name__ == "__main__":  # run the installed module, so the id names the same classes
    from masenvs.integrations.verifiers import main as _main

    _main()
else:  # verifiers imports a taskset id as a top-level module: `masenvs-verifiers` is this one
    sys.modules.setdefault(TASKSET_ID.replace("-", "_"), sys.modules[__name__])
