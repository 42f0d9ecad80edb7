"""Where a training step's samples come from: env roles played with AT-GRPO tree (or
trajectory) sampling (`TreeSource`), or a framework program run K times per task
(`WorkflowSource`); each also runs the validation episodes. Plus the env and sampling
settings of a run, which the training loop and the rollout workers share."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.progress import Progress

from masenvs.adapters.episodes import EpisodeResult, episode_record, run_episodes
from masenvs.adapters.policy import ChatPolicy, Sampling
from masenvs.adapters.stack import Stack, with_endpoint
from masenvs.engine.protocol import honours_seed
from masenvs.env import MASEnv
from masenvs.registry import make
from masenvs.trainer.config import ConfigError, TrainConfig, check_env
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.rollout.captured import captured_samples, write_designs
from masenvs.trainer.rollout.tree import (
    TaskRollout,
    collect_trajectory_batch,
    collect_tree_batch,
    team_term_metrics,
)
from masenvs.trainer.samples import Sample

log = logging.getLogger(__name__)


def run_counter(progress: Progress, description: str, total: int) -> Callable[[Any], None]:
    """An `on_run` callback that advances a bar of `total` runs on `progress`; in a log,
    a line per run: `validation runs 2/4: failed (ProgramTimeout), 12 s, ETA 24 s`."""
    bar = progress.add_task(description, total=total)
    started, done = time.perf_counter(), [0]

    def on_run(run: Any) -> None:
        done[0] += 1
        progress.advance(bar)
        if progress.console.is_terminal:
            return
        seconds = time.perf_counter() - started
        outcome = "success" if run.success else "no success"
        if run.error:
            outcome = f"failed ({run.error.split(':', 1)[0]})"
        left = seconds / done[0] * (total - done[0])
        progress.console.print(
            f"{description} {done[0]}/{total}: {outcome}, {seconds:.0f} s, ETA {left:.0f} s"
        )

    return on_run


def env_options(cfg: TrainConfig, stack: Stack | None = None) -> dict[str, Any]:
    """The env's config: `env.options`, the rollout's turn order and rounds, and for envs
    that call the endpoint themselves (auto-MAS) its URL and key, unless set."""
    options = dict(cfg.env.options)
    if stack is not None:
        options = with_endpoint(cfg.env.name, options, stack.root_url, stack.api_key)
    if options.get("turn_order", cfg.rollout.turn_order) != cfg.rollout.turn_order:
        raise ValueError(
            f"env.options.turn_order={options['turn_order']!r} contradicts rollout.turn_order="
            f"{cfg.rollout.turn_order!r}: set rollout.turn_order only"
        )
    options["turn_order"] = cfg.rollout.turn_order
    if cfg.rollout.max_rounds is not None:
        options["max_rounds"] = cfg.rollout.max_rounds
    return options


def env_factory(cfg: TrainConfig, stack: Stack | None = None) -> Callable[[], MASEnv]:
    options = env_options(cfg, stack)
    make(cfg.env.name, **options)  # a bad env name or option fails here, before any model loads
    return lambda: make(cfg.env.name, **options)


def agent_sampling(
    cfg: TrainConfig, agents: list[str], *, validation: bool = False
) -> dict[str, Sampling]:
    """Each agent's sampling settings: `agents.<name>` over `rollout.*`.

    Validation keeps `validation.temperature` (greedy by default) for every agent and the
    run's seed; top_p and max_tokens stay the agent's own.
    """
    unknown = sorted(set(cfg.agents) - set(agents))
    if unknown:
        raise ConfigError(
            f"agents.{unknown[0]} in the config is not an agent of this run ({', '.join(agents)}); "
            "fix the name or remove the section"
        )
    out = {}
    for name in agents:
        a = cfg.sampling(name)
        if validation:  # the ref validates without top-k and repetition penalty
            out[name] = validation_sampling(cfg, top_p=a.top_p, max_tokens=a.max_tokens)
        else:
            out[name] = Sampling(**dataclasses.asdict(a))
    return out


def validation_sampling(cfg: TrainConfig, **agent: Any) -> Sampling:
    """`validation.temperature` and the run's seed, over the rollout's max_tokens (or the
    agent's `agent` settings)."""
    return Sampling(
        temperature=cfg.validation.temperature,
        max_tokens=agent.pop("max_tokens", cfg.rollout.max_tokens),
        seed=cfg.seed,
        **agent,
    )


def rollout_metrics(results: list[TaskRollout]) -> dict[str, float]:
    ok = [r for r in results if r.error is None]
    out: dict[str, float] = {
        "train/success": sum(r.success for r in ok) / max(len(ok), 1),
        "train/rounds": sum(r.rounds for r in ok) / max(len(ok), 1),
        "train/failed_tasks": float(len(results) - len(ok)),
    }
    out |= episode_rates("train", [r.metrics for r in ok])
    path_rewards: dict[str, list[float]] = defaultdict(list)
    for r in ok:
        for agent, reward in r.rewards.items():
            path_rewards[agent].append(reward)
    for agent, values in path_rewards.items():
        out[f"train/episode_reward/{agent}"] = sum(values) / len(values)
    return out


def rollout_sample_seed(cfg: TrainConfig, backend: Any) -> int | None:
    """The seed training calls derive theirs from (`rollout.seeded`), where the backend
    samples seeds as asked; None elsewhere (vLLM's CPU build: docs/vllm.md), said once."""
    if cfg.sample_seed is None or honours_seed(backend):
        return cfg.sample_seed
    log.warning(
        "rollout.seeded is on, but the %s backend does not honour per-call seeds "
        "(docs/vllm.md): training calls go unseeded, so a rerun samples other candidates",
        getattr(backend, "name", type(backend).__name__),
    )
    return None


class TreeSource:
    """Env roles sampled with AT-GRPO tree sampling; validation runs independent episodes."""

    def __init__(self, cfg: TrainConfig, stack: Stack, learner: Learner) -> None:
        self.cfg, self.stack, self.learner = cfg, stack, learner
        self.make_env = env_factory(cfg, stack)
        self.val_options = env_options(cfg, stack) | cfg.validation.env_options
        if cfg.validation.env_options:  # load_config checked them; a config built in code too
            check_env(cfg)
        self.policy = ChatPolicy(
            stack.root_url,
            sampling=Sampling(**dataclasses.asdict(cfg.sampling())),
            agent_sampling=agent_sampling(cfg, learner.agents),
            api_key=stack.api_key or "masenvs",
            timeout=cfg.backend.request_timeout,
        )
        self.last_errors: list[str] = []  # the last step's failed tasks, for an empty step
        self.sample_seed = rollout_sample_seed(cfg, stack.backend)
        self.pool = None
        if (
            cfg.distributed.rollout_workers
        ):  # episodes run in Ray actors (trainer/rollout/workers.py)
            from masenvs.trainer.rollout.workers import RolloutPool, worker_spec

            policies = {agent: learner.policy_of(agent) for agent in learner.agents}
            spec = worker_spec(cfg, stack, self.policy, policies, env_options(cfg))
            self.pool = RolloutPool(spec, cfg.distributed)

    async def collect(self, step: int, seeds: list[int]) -> tuple[list[Sample], dict[str, float]]:
        cfg = self.cfg
        started = time.time()
        if self.pool is not None:  # the workers play cfg.rollout.mode too (worker_spec)
            results = await asyncio.to_thread(self.pool.tree, f"s{step}", seeds)
        elif cfg.rollout.mode in ("trajectory", "no_tree"):
            results = await collect_trajectory_batch(
                self.make_env,
                seeds,
                self.policy,
                branches=cfg.rollout.branches,
                policy_of=self.learner.policy_of,
                group_by=cfg.rollout.group_by,
                no_tree=cfg.rollout.mode == "no_tree",
                rollout_prefix=f"s{step}",
                concurrency=cfg.rollout.concurrency,
                sample_seed=self.sample_seed,
            )
        else:
            results = await collect_tree_batch(
                self.make_env,
                seeds,
                self.policy,
                branches=cfg.rollout.branches,
                policy_of=self.learner.policy_of,
                select_by=cfg.rollout.select_by,
                rollout_prefix=f"s{step}",
                concurrency=cfg.rollout.concurrency,
                sample_seed=self.sample_seed,
                group_by=cfg.rollout.group_by,
                team_credit=cfg.rollout.team_credit,
            )
        for r in results:
            if r.error:
                log.warning("task %s dropped from step %d: %s", r.task_id, step, r.error)
        self.last_errors = [r.error for r in results if r.error]
        samples = [s for r in results for s in r.samples]
        metrics = rollout_metrics(results) | team_term_metrics(samples)
        if cfg.rollout.team_credit == "paired":  # the continuations' extra calls, this step
            metrics["train/paired_calls"] = float(sum(r.paired_calls for r in results))
        if self.pool is not None:
            metrics.update(self.pool.metrics())
        captured = [(r.task_id, c) for r in results for c in r.captured]
        if captured and self.stack.store is not None:
            samples += captured_samples(
                self.stack.store,
                [c for _, c in captured],
                task_of={c["rollout_id"]: task for task, c in captured},
                policy_of=self.learner.policy_of,
                group_by=cfg.algorithm.caller_group,
                since=started,
            )
            metrics["train/captured_runs"] = float(len(captured))
        designs = [d for r in results for d in r.designs]
        if designs:
            write_designs(Path(cfg.run_dir) / "designs.jsonl", step, designs)
            failed = [d for d in designs if d["error"]]
            metrics["train/design_failure_rate"] = len(failed) / len(designs)
        return samples, metrics

    def why_no_samples(self) -> str:
        errors = self.last_errors
        return f"every task failed ({errors[0]})" if errors else "the tasks gave no sample"

    async def validate(self, step: int, progress: Progress | None = None) -> dict[str, float]:
        """Validation episodes; `progress` counts their calls, with an ETA (in a log, a line
        per episode)."""
        cfg = self.cfg
        sampling = validation_sampling(cfg)
        if self.pool is not None:
            agents = agent_sampling(cfg, self.learner.agents, validation=True)
            seeds = list(cfg.validation_seeds())
            results = await asyncio.to_thread(
                self.pool.episodes, f"val{step}", seeds, sampling, agents
            )
            for r in results:  # workers have no store: the episodes are recorded here
                if self.stack.store is not None:
                    self.stack.store.append(episode_record(r))
            return validation_metrics(results) | self.pool.metrics("val")
        policy = ChatPolicy(
            self.stack.root_url,
            sampling=sampling,
            agent_sampling=agent_sampling(cfg, self.learner.agents, validation=True),
            api_key=self.policy.api_key,
            timeout=self.policy.timeout,
        )
        try:
            results = await run_episodes(
                cfg.env.name,
                policy,
                list(cfg.validation_seeds()),
                env_config=self.val_options,
                store=self.stack.store,
                concurrency=cfg.rollout.concurrency,
                progress=progress,
                rollout_prefix=f"val{step}",
            )
        finally:
            await policy.aclose()
        return validation_metrics(results)

    async def aclose(self) -> None:
        if self.pool is not None:
            self.pool.close()
        await self.policy.aclose()


def episode_rates(kind: str, metrics: list[dict[str, float]]) -> dict[str, float]:
    """The env's episode metrics (plan-path: optimal, exact_stop) averaged over the episodes,
    as `<kind>/<name>`; an episode without one (cut short) counts 0."""
    names = sorted({name for m in metrics for name in m})
    return {f"{kind}/{n}": sum(m.get(n, 0.0) for m in metrics) / len(metrics) for n in names}


def validation_metrics(results: list[EpisodeResult]) -> dict[str, float]:
    """Success and mean rewards; `val/errors` counts episodes cut short by a failed call (a
    timeout, a dead server), which count as failures, each logged with its error."""
    failed = [r for r in results if r.error]
    for r in failed:
        log.warning("validation episode %s:%d failed: %s", r.env, r.seed, r.error)
    out = {"val/success": sum(r.success for r in results) / len(results)}
    out |= episode_rates("val", [r.metrics if not r.error else {} for r in results])
    out["val/episodes"], out["val/errors"] = float(len(results)), float(len(failed))
    for agent in sorted({a for r in results for a in r.rewards}):
        rewards = [r.rewards.get(agent, 0.0) for r in results]
        out[f"val/reward/{agent}"] = sum(rewards) / len(rewards)
    return out


class WorkflowSource:
    """A framework program run K times per task; every call it made is a sample."""

    def __init__(self, cfg: TrainConfig, stack: Stack, learner: Learner) -> None:
        from masenvs.adapters.frameworks.clients import ClientSettings

        self.cfg, self.stack, self.learner = cfg, stack, learner
        if cfg.validation.env_options:  # an error: a workflow validates on the tasks it is given
            check_env(cfg)
        self.spec = cfg.workflow
        self.settings = ClientSettings(
            sampling=Sampling(**dataclasses.asdict(cfg.sampling())),
            agents=agent_sampling(cfg, learner.agents),
            api_key=stack.api_key or "masenvs",
        )
        self.val_settings = ClientSettings(
            sampling=validation_sampling(cfg),
            agents=agent_sampling(cfg, learner.agents, validation=True),
            api_key=stack.api_key or "masenvs",
        )
        from masenvs.trainer.rollout.workflow import FailureWindow

        self.failures = FailureWindow(self.spec.failure_window, self.spec.max_failure_rate)
        self.last_runs: list[Any] = []
        for name, agent in self.spec.agent_map.items():  # a mapped name samples as its agent
            self.settings.agents[name] = self.settings.agents[agent]
            self.val_settings.agents[name] = self.val_settings.agents[agent]
        self.pool = None
        if (
            cfg.distributed.rollout_workers
        ):  # the program runs in Ray actors (trainer/rollout/workers.py)
            from masenvs.trainer.rollout.workers import RolloutPool, workflow_worker_spec

            self.pool = RolloutPool(workflow_worker_spec(cfg, stack), cfg.distributed)

    async def _runs(self, step, seeds, branches, settings, on_run=None):
        from masenvs.trainer.rollout.workflow import collect_workflow_samples

        if self.pool is not None:
            from masenvs.trainer.rollout.workers import collect_workflow

            policy_of = self.learner.policy_of
            return await collect_workflow(
                self.pool,
                self.stack,
                step=step,
                seeds=seeds,
                branches=branches,
                settings=settings,
                policy_of=policy_of,
            )

        return await collect_workflow_samples(
            self.spec,
            root_url=self.stack.root_url,
            store=self.stack.store,
            env_name=self.cfg.env.name,
            seeds=seeds,
            branches=branches,
            env_options=self.cfg.env.options,
            settings=settings,
            policy_of=self.learner.policy_of,
            endpoint=self.stack.endpoint,
            step=step,
            concurrency=self.cfg.rollout.concurrency,
            on_run=on_run,
        )

    async def collect(self, step: int, seeds: list[int]) -> tuple[list[Sample], dict[str, float]]:
        from masenvs.trainer.rollout.workflow import check_unknown_agents, workflow_metrics

        # Each failed run is logged once, by run_workflow; the detail is in its episode record.
        samples, runs = await self._runs(step, seeds, self.cfg.rollout.branches, self.settings)
        check_unknown_agents(self.stack.endpoint.policy_map, runs)  # before any update
        self.last_runs = runs
        self.failures.check(runs)  # too many failed runs: stop before training on them
        metrics = workflow_metrics(runs, samples)
        return samples, metrics | (self.pool.metrics() if self.pool is not None else {})

    def why_no_samples(self) -> str:
        from masenvs.trainer.rollout.workflow import why_no_samples

        return why_no_samples(self.last_runs)

    async def validate(self, step: int, progress: Progress | None = None) -> dict[str, float]:
        """One run per validation task; `progress` counts them, with an ETA."""
        seeds = list(self.cfg.validation_seeds())
        on_run = run_counter(progress, "validation runs", len(seeds)) if progress else None
        _, runs = await self._runs(-step - 1, seeds, 1, self.val_settings, on_run)
        return {
            "val/success": sum(r.success for r in runs) / len(runs),
            "val/reward": sum(r.reward for r in runs) / len(runs),
        } | episode_rates("val", [r.metrics for r in runs])

    async def aclose(self) -> None:
        if self.pool is not None:
            self.pool.close()
