"""Workflow mode: a user's whole multi-agent program solves env tasks; the env scores it.

One run = one task (an env seed) solved once by the program:

1. The env is made in single-agent mode with one round (`single_agent=True, max_rounds=1`);
   its solo role's first prompt is the task.
2. The factory named in the config builds the program from a `WorkflowContext` whose
   clients point at the run's endpoint URL (`/r/{rollout_id}/v1`), one model name per agent.
3. The program runs (LangGraph graph, AutoGen team, LlamaIndex workflow); its final text is
   the solo role's action, and `env.step` gives the run's reward and success.
4. A failure (an exception in the program, a recursion limit, a timeout) ends the run with
   the failure reward and a logged reason; other runs go on.

Every LLM call the program made is in the trace under the run's rollout id, attributed to
its agent and numbered per agent (`call_index`); `masenvs.trainer.rollout.workflow` turns them into
training samples, K runs per task grouped by (task, agent, call index).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from masenvs.adapters.frameworks.clients import (
    Clients,
    ClientSettings,
    UnknownAgent,
    check_server,
    rollout_url,
)
from masenvs.adapters.frameworks.factory import (
    Factory,
    WorkflowContext,
    bind_clients,
    load_factory,
)
from masenvs.adapters.frameworks.programs import (
    Isolation,
    RunLimits,
    check_program,
    error_detail,
    failure_reason,
    run_isolated,
    run_program,
    warn_if_empty,
)
from masenvs.env import messages_to_text
from masenvs.registry import make
from masenvs.traces import EpisodeRecord, TraceStore

log = logging.getLogger("masenvs.frameworks")


class WorkflowSpec(BaseModel):
    """The `workflow:` section of a training config: which program, and how it runs."""

    model_config = ConfigDict(extra="forbid")

    factory: str = Field(
        description="'module:function' or 'path/to/file.py:function'; the function takes a "
        "WorkflowContext and returns the program (it may be async)."
    )
    framework: Literal["langgraph", "autogen", "llamaindex"] = Field(
        description="Which framework's clients the factory gets and how the program is run."
    )
    agents: list[str] = Field(
        min_length=1,
        description="Model names the program's clients use, one per agent; each is routed by "
        "the policy map and trains its own adapter (or the shared one).",
    )
    unknown_agents: Literal["reject", "base", "map"] = Field(
        "reject",
        description="Model names the program uses that are not in `agents`: 'reject' fails the "
        "run at the first such call and stops training with the name; 'base' serves them "
        "with the base model and never trains on them; 'map' routes each name of "
        "`agent_map` to that agent's policy and trains it as that agent (other names are "
        "rejected).",
    )
    agent_map: dict[str, str] = Field(
        default_factory=dict,
        description="With unknown_agents 'map': {model name: agent}, e.g. {critic_v2: critic}.",
    )
    llm_args: dict[str, str] = Field(
        default_factory=dict,
        description="For a factory that is the agent's own builder, taking one client per "
        "parameter: {parameter: agent}, e.g. {solver_llm: solver}; each parameter gets that "
        "agent's framework client. Empty: inferred from the names (solver_llm, solver_client "
        "-> solver; llm, model_client -> the only agent).",
    )
    answer_from: str | None = Field(
        None,
        description="Where the final answer is: LangGraph state key or AutoGen agent name. "
        "None: the last AI message (LangGraph), the last agent message (AutoGen), the "
        "agent workflow's response (LlamaIndex).",
    )
    input: dict[str, Any] | None = Field(
        None,
        description="LangGraph: the graph's input state, {state key: template}, for a graph "
        "with a state of its own, e.g. {question: '{task}', tries: 0}. Templates fill in "
        "{task} (the task as text), {env} and {seed}; '{messages}' alone is the task as chat "
        "messages. None: {messages: [the task as chat messages]} (MessagesState).",
    )
    recursion_limit: int = Field(25, ge=1, description="LangGraph super-steps per run.")
    timeout_s: float | None = Field(
        600.0, gt=0, description="Wall seconds per run before it fails; None: no limit."
    )
    max_failure_rate: float = Field(
        0.9,
        ge=0.0,
        le=1.0,
        description="Training stops (exit status 1, with the most common failure reason) when "
        "more than this share of the last `failure_window` runs failed; 1.0: never.",
    )
    failure_window: int = Field(
        32, ge=1, description="Runs (the latest, across steps) the failure share is taken over."
    )
    failure_reward: float | None = Field(
        None,
        description="Reward of a failed run. None: what the env gives an empty answer (its "
        "format penalty).",
    )

    @model_validator(mode="after")
    def _answer_from_fits_the_framework(self) -> WorkflowSpec:
        if self.framework == "llamaindex" and self.answer_from is not None:
            raise ValueError(
                "answer_from is not supported with framework 'llamaindex' (the answer is the "
                "agent workflow's response or the StopEvent's result); remove answer_from, or "
                "return the answer from a custom Workflow's StopEvent"
            )
        return self

    @model_validator(mode="after")
    def _input_is_langgraphs(self) -> WorkflowSpec:
        if self.input is not None and self.framework != "langgraph":
            raise ValueError(
                f"input maps a LangGraph state; framework {self.framework!r} is asked the task "
                "as text: remove input"
            )
        if self.input is not None and not self.input:
            raise ValueError(
                "input is empty: map at least one state key, e.g. {question: '{task}'}"
            )
        return self

    @model_validator(mode="after")
    def _agent_map_names_agents(self) -> WorkflowSpec:
        if self.unknown_agents == "map" and not self.agent_map:
            raise ValueError(
                "unknown_agents 'map' needs agent_map, e.g. {critic_v2: critic}: which agent's "
                "policy each extra model name trains"
            )
        if self.agent_map and self.unknown_agents != "map":
            raise ValueError(
                f"agent_map is set but unknown_agents is {self.unknown_agents!r}; set "
                "unknown_agents: map to use it"
            )
        for name, agent in self.agent_map.items():
            if agent not in self.agents:
                raise ValueError(
                    f"agent_map sends {name!r} to {agent!r}, which is not one of agents "
                    f"({', '.join(self.agents)})"
                )
            if name in self.agents:
                raise ValueError(f"agent_map maps {name!r}, which already is an agent")
        for param, agent in self.llm_args.items():
            if agent not in self.agents and agent not in self.agent_map:
                raise ValueError(
                    f"llm_args gives {param!r} the client of {agent!r}, which is not one of "
                    f"agents ({', '.join(self.agents)})"
                )
        return self

    def agent_of(self, name: str) -> str | None:
        """The agent whose policy a call of model `name` trains; None: no policy's call."""
        if name in self.agents:
            return name
        return self.agent_map.get(name)

    def client_names(self) -> list[str] | None:
        """The agent names `ctx.clients` accepts; None: any (unknown_agents 'base')."""
        if self.unknown_agents == "base":
            return None
        return [*self.agents, *self.agent_map]

    def builder(self, factory: Factory | None = None) -> Factory:
        """The factory (imported unless given) as a function of the WorkflowContext."""
        factory = factory or load_factory(self.factory)
        names = self.client_names() or self.agents
        return bind_clients(factory, self.factory, names, self.llm_args)

    def limits(self) -> RunLimits:
        return RunLimits(self.answer_from, self.recursion_limit, self.timeout_s, self.input)


@dataclass
class WorkflowRun:
    """The outcome of one run of the program on one task."""

    rollout_id: str
    task_id: str  # "<env>:<seed>"; the K runs of a task share it
    seed: int
    run_index: int
    reward: float  # the run's episode reward; every call of the run trains with it
    success: bool
    answer: str
    error: str | None  # why the program failed, if it did
    seconds: float
    started_at: float  # unix time
    ended_at: float = 0.0  # unix time; calls that start later (a hung run's) never train
    metrics: dict[str, float] = field(default_factory=dict)  # env.episode_metrics(); {} if failed
    call_seconds: list[float] = field(default_factory=list)  # its LLM calls' latencies


def check_factory(
    spec: WorkflowSpec,
    env_name: str,
    env_options: dict[str, Any] | None = None,
    factory: Factory | None = None,
) -> Factory:
    """Import the factory, build the program for the first task with clients that answer no
    call, and check it (its kind, a LangGraph graph's input state): a broken factory fails
    in one line before any model loads. Returns the factory."""
    factory = spec.builder(factory)
    env = make(env_name, **task_env_options(env_options or {}))
    _, infos = env.reset(seed=0)
    messages = infos[env.possible_agents[0]]["messages"]
    url = rollout_url("http://127.0.0.1:9", "check")

    async def build() -> None:
        clients = Clients(spec.framework, url, spec.client_names())
        clients.revoke("masenvs checks the factory before the model loads: no call is answered")
        try:
            context = WorkflowContext(
                clients=clients,
                messages=messages,
                task=messages_to_text(messages),
                base_url=url,
                rollout_id="check",
                env=env.name,
                seed=0,
                run_index=0,
                task_info=dict(infos[env.possible_agents[0]].get("task", {})),
            )
            try:
                program = factory(context)
                if inspect.isawaitable(program):
                    program = await program
            except UnknownAgent:
                raise  # names the agent and the fix already (the trainer's UnknownAgentError)
            except Exception as exc:
                raise ValueError(
                    f"factory {spec.factory!r} failed to build the program: {failure_reason(exc)}"
                ) from exc
            check_program(spec.framework, program)
            if spec.framework == "langgraph":
                from masenvs.adapters.frameworks.langgraph import (
                    check_answer_from,
                    check_input,
                    is_program,
                )

                if is_program(program):
                    check_input(program, spec.input)
                    check_answer_from(program, spec.answer_from)
            elif spec.framework == "autogen":
                from masenvs.adapters.frameworks import autogen

                if autogen.is_program(program):
                    autogen.check_answer_from(program, spec.answer_from)
        finally:
            await clients.aclose()

    asyncio.run(build())
    return factory


def task_env_options(options: dict[str, Any]) -> dict[str, Any]:
    """Env options of workflow mode: the solo role answers once."""
    return {**options, "single_agent": True, "max_rounds": 1}


async def run_workflow(
    spec: WorkflowSpec,
    *,
    root_url: str,
    env_name: str,
    seed: int,
    env_options: dict[str, Any] | None = None,
    run_index: int = 0,
    rollout_id: str | None = None,
    settings: ClientSettings | None = None,
    store: TraceStore | None = None,
    endpoint: Any = None,
    factory: Factory | None = None,
) -> WorkflowRun:
    """One run of the program on task `seed` of `env_name`; never raises for the program's
    failures (they give the failure reward). `endpoint` (optional) gets the run's metadata."""
    factory = spec.builder(factory)
    rollout_id = rollout_id or f"wf-{seed}-{run_index}"
    env = make(env_name, **task_env_options(env_options or {}))
    _, infos = env.reset(seed=seed)
    solo = env.possible_agents[0]
    messages = infos[solo]["messages"]
    task_id = f"{env.name}:{seed}"
    url = rollout_url(root_url, rollout_id)
    if endpoint is not None:
        endpoint.set_rollout_metadata(
            rollout_id, {"task_id": task_id, "seed": seed, "run_index": run_index}
        )
    context_of = dict(
        messages=messages,
        task=messages_to_text(messages),
        base_url=url,
        rollout_id=rollout_id,
        env=env.name,
        seed=seed,
        run_index=run_index,
        task_info=dict(infos[solo].get("task", {})),
    )
    started_at, started = time.time(), time.perf_counter()
    answer, error, detail = "", None, None
    isolation = Isolation(f"masenvs-run-{rollout_id}")
    try:
        answer = await _answer(spec, factory, settings, context_of, isolation)
    except Exception as exc:  # the user's program failing ends this run, not the batch
        error, detail = failure_reason(exc), error_detail(exc, isolation)
        log.warning("workflow run %s (%s) failed: %s", rollout_id, task_id, error)
    finally:
        if endpoint is not None:
            endpoint.end_rollout(rollout_id, refuse_late_calls=True)
    ended_at = time.time()
    # Env steps may run sandboxed programs: keep them off the event loop.
    # An answer read from the graph's own state is bare ('14'): the env puts it in its format.
    action = (
        env.answer_action(answer) if spec.answer_from and spec.framework == "langgraph" else answer
    )
    _, rewards, _, _, _ = await asyncio.to_thread(env.step, {solo: action})
    reward = rewards[solo]
    if error is not None and spec.failure_reward is not None:
        reward = spec.failure_reward
    run = WorkflowRun(
        rollout_id=rollout_id,
        task_id=task_id,
        seed=seed,
        run_index=run_index,
        reward=float(reward),
        success=error is None and bool(env.state.success),
        answer=answer,
        error=error,
        seconds=time.perf_counter() - started,
        started_at=started_at,
        ended_at=ended_at,
        metrics=env.episode_metrics() if error is None else {},
    )
    if store is not None:
        # framework warnings of a run that went on (a failed run's are in detail)
        logs = isolation.logs if error is None else []
        version = getattr(endpoint, "policy_version", None)
        store.append(_episode_record(spec, run, env.name, detail, logs, version))
    return run


async def _answer(
    spec: WorkflowSpec,
    factory: Factory,
    settings: ClientSettings | None,
    context_of: dict[str, Any],
    isolation: Isolation,
) -> str:
    """Build the program for this run and run it in `isolation` (its own thread, event loop
    and deadline): the program's final text. Raises what the program raised."""
    url, rollout_id, messages = (context_of[k] for k in ("base_url", "rollout_id", "messages"))
    limits = dataclasses.replace(  # the thread's deadline rules
        spec.limits(),
        timeout_s=None,
        input_fields={"env": context_of["env"], "seed": context_of["seed"]},
    )

    async def body(isolation: Isolation) -> str:
        # Runs in the run's own thread and event loop: clients, program and all.
        clients = Clients(spec.framework, url, spec.client_names(), settings)
        isolation.on_timeout.append(
            lambda: clients.revoke(f"run {rollout_id} ended at its timeout_s={spec.timeout_s:g}")
        )
        try:
            program = factory(WorkflowContext(clients=clients, **context_of))
            if inspect.isawaitable(program):
                program = await program
            check_program(spec.framework, program)
            return await run_program(spec.framework, program, messages, limits)
        finally:
            await clients.aclose()

    answer = await run_isolated(body, spec.timeout_s, isolation)
    kind = ("workflow", spec.factory, spec.framework, spec.answer_from)
    where = f"workflow run {rollout_id} ({spec.factory})"
    warn_if_empty(answer, kind, spec.framework, spec.answer_from, where)
    return answer


def _episode_record(
    spec: WorkflowSpec,
    run: WorkflowRun,
    env_name: str,
    detail: str | None,
    framework_logs: list,
    policy_version: int | None,
) -> EpisodeRecord:
    """The run as the trace store keeps it: every agent gets the run's reward."""
    return EpisodeRecord(
        rollout_id=run.rollout_id,
        task_id=run.task_id,
        env=env_name,
        rewards=dict.fromkeys(spec.agents, run.reward),
        success=run.success,
        extra={
            "mode": "workflow",
            "framework": spec.framework,
            "seed": run.seed,
            "run_index": run.run_index,
            "error": run.error,
            "error_detail": detail,
            "framework_logs": framework_logs,
            "answer": run.answer[:2000],
            **({"metrics": run.metrics} if run.metrics else {}),
        },
        policy_version=policy_version,
    )


async def run_tasks(
    spec: WorkflowSpec,
    *,
    root_url: str,
    env_name: str,
    seeds: list[int],
    branches: int,
    env_options: dict[str, Any] | None = None,
    settings: ClientSettings | None = None,
    store: TraceStore | None = None,
    endpoint: Any = None,
    prefix: str = "wf",
    concurrency: int = 8,
    on_run: Callable[[WorkflowRun], None] | None = None,
    factory: Factory | None = None,
) -> list[WorkflowRun]:
    """K = `branches` independent runs of every task, `concurrency` at a time.

    `root_url` is the masenvs server, as its root or its `/v1` URL (what `masenvs serve`
    prints); it is checked once, up front. Rollout ids are `{prefix}-{seed}-{k}`; runs come
    back ordered by (seed, k). `factory` overrides `spec.factory` (a function instead of
    its import path).
    """
    if branches < 1:
        raise ValueError(f"branches (K, runs of each task) must be at least 1, got {branches}")
    factory = spec.builder(factory)  # a bad factory fails once, up front
    make(env_name, **task_env_options(env_options or {}))  # and so does a bad env config
    root_url = await check_server(root_url, (settings or ClientSettings()).api_key)
    limit = asyncio.Semaphore(concurrency)

    async def one(seed: int, k: int) -> WorkflowRun:
        async with limit:
            run = await run_workflow(
                spec,
                root_url=root_url,
                env_name=env_name,
                seed=seed,
                env_options=env_options,
                run_index=k,
                rollout_id=f"{prefix}-{seed}-{k}",
                settings=settings,
                store=store,
                endpoint=endpoint,
                factory=factory,
            )
        if on_run is not None:
            on_run(run)
        return run

    return list(await asyncio.gather(*(one(seed, k) for seed in seeds for k in range(branches))))
