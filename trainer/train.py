"""The AT-GRPO training loop: rollout -> advantages -> update -> weight sync, step after step.

Everything runs in one process tree: the learner (peft LoRA), the inference backend behind
the capture endpoint, and the env rollouts. `train(cfg)` is what `masenvs train` calls.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from masenvs.adapters.policy import ChatPolicy, Sampling
from masenvs.adapters.rollout import run_episodes
from masenvs.adapters.stack import Stack, make_backend, start_stack
from masenvs.env import MASEnv
from masenvs.registry import make
from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.checkpoint import TrainState, load_latest, save_checkpoint
from masenvs.trainer.config import TrainConfig, save_config
from masenvs.trainer.learner import Learner
from masenvs.trainer.metrics import MetricsLogger, group_metrics, read_metrics, sample_metrics
from masenvs.trainer.plots import plot_curves
from masenvs.trainer.rollout import TaskRollout, collect_tree_batch
from masenvs.trainer.sync import WeightSync


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    validation: list[dict[str, float]]  # one entry per validation: step, success, rewards
    plot: Path | None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def env_factory(cfg: TrainConfig) -> Callable[[], MASEnv]:
    options = dict(cfg.env.options)
    if cfg.rollout.max_rounds is not None:
        options["max_rounds"] = cfg.rollout.max_rounds
    make(cfg.env.name, **options)  # a bad env name or option fails here, before any model loads
    return lambda: make(cfg.env.name, **options)


def rollout_metrics(results: list[TaskRollout], seconds: float) -> dict[str, float]:
    ok = [r for r in results if r.error is None]
    out: dict[str, float] = {
        "train/success": sum(r.success for r in ok) / max(len(ok), 1),
        "train/rounds": sum(r.rounds for r in ok) / max(len(ok), 1),
        "train/failed_tasks": float(len(results) - len(ok)),
        "time/rollout_s": seconds,
        "throughput/rollout_tokens_per_s": sum(r.completion_tokens for r in results) / seconds,
    }
    path_rewards: dict[str, list[float]] = defaultdict(list)
    for r in ok:
        for agent, reward in r.rewards.items():
            path_rewards[agent].append(reward)
    for agent, values in path_rewards.items():
        out[f"train/episode_reward/{agent}"] = sum(values) / len(values)
    return out


async def validate(cfg: TrainConfig, stack: Stack, step: int) -> dict[str, float]:
    """Independent (non-branching) episodes on held-out seeds; `val/...` metrics."""
    sampling = Sampling(
        temperature=cfg.validation.temperature,
        top_p=1.0,
        max_tokens=cfg.rollout.max_tokens,
        seed=cfg.seed,
    )
    policy = ChatPolicy(stack.base_url, sampling=sampling, api_key=stack.api_key or "masenvs")
    seeds = list(
        range(cfg.validation.seed_start, cfg.validation.seed_start + cfg.validation.episodes)
    )
    options = dict(cfg.env.options)
    if cfg.rollout.max_rounds is not None:
        options["max_rounds"] = cfg.rollout.max_rounds
    try:
        results = await run_episodes(
            cfg.env.name,
            policy,
            seeds,
            env_config=options,
            store=stack.store,
            concurrency=cfg.rollout.concurrency,
            rollout_prefix=f"val{step}",
        )
    finally:
        await policy.aclose()
    out = {"val/success": sum(r.success for r in results) / len(results)}
    agents = sorted({a for r in results for a in r.rewards})
    for agent in agents:
        out[f"val/reward/{agent}"] = sum(r.rewards.get(agent, 0.0) for r in results) / len(results)
    return out


def train(cfg: TrainConfig, *, console: Console | None = None) -> TrainResult:
    """Run (or resume) the training described by `cfg`; returns where everything went."""
    console = console or Console()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    make_env = env_factory(cfg)
    agents = make_env().possible_agents

    with console.status(f"loading {cfg.model.name} for the learner"):
        learner = Learner(cfg, agents)
    state = TrainState(step=0, next_task_seed=cfg.env.seed_start)
    checkpoint = load_latest(run_dir) if cfg.checkpoint.resume else None
    if checkpoint is not None:
        state = checkpoint.restore(learner)
        console.print(f"resumed from {checkpoint.path} (step {state.step})")
    save_config(cfg, run_dir / "config.yaml")

    with console.status(f"starting the {cfg.backend.kind} backend"):
        backend = make_backend(
            cfg.model.name,
            cfg.backend.kind,
            cfg.backend.vllm_url,
            **(
                {"max_batch_size": cfg.backend.max_batch_size}
                if cfg.backend.kind == "embedded"
                else {}
            ),
        )
        sync = WeightSync(learner, backend, run_dir / "sync")
        sync.push(version=state.step)
        routes = {agent: learner.policy_of(agent) for agent in agents}
        stack = start_stack(backend=backend, traces=run_dir / "traces", policy_map=routes)
    stack.endpoint.policy_version = state.step
    metrics = MetricsLogger(run_dir, cfg.logging, cfg, resume_step=state.step)
    validations: list[dict[str, float]] = []
    try:
        asyncio.run(
            _loop(cfg, learner, stack, sync, metrics, make_env, state, console, validations)
        )
    finally:
        metrics.close()
        stack.close()
    plot = plot_curves(
        run_dir / "metrics.jsonl", run_dir / "curves.png", title=f"{cfg.env.name}: AT-GRPO"
    )
    console.print(f"curves: {plot}\nmetrics: {run_dir / 'metrics.jsonl'}")
    validations = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val/success" in r]
    return TrainResult(run_dir, cfg.steps, validations, plot)


async def _loop(
    cfg: TrainConfig,
    learner: Learner,
    stack: Stack,
    sync: WeightSync,
    metrics: MetricsLogger,
    make_env: Callable[[], MASEnv],
    state: TrainState,
    console: Console,
    validations: list[dict[str, float]],
) -> None:
    agents = learner.agents
    sampling = Sampling(
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        max_tokens=cfg.rollout.max_tokens,
    )
    policy = ChatPolicy(stack.base_url, sampling=sampling, api_key=stack.api_key or "masenvs")
    every = cfg.validation.every
    try:
        if every and state.step == 0:
            with console.status("validating before training"):
                val = await validate(cfg, stack, 0)
            metrics.log(0, val)
            validations.append({"step": 0, **val})
            console.print(f"step 0 validation: success {val['val/success']:.0%}")
        for step in range(state.step + 1, cfg.steps + 1):
            seeds = list(
                range(state.next_task_seed, state.next_task_seed + cfg.rollout.tasks_per_step)
            )
            started = time.perf_counter()
            results = await collect_tree_batch(
                make_env,
                seeds,
                policy,
                branches=cfg.rollout.branches,
                policy_of=learner.policy_of,
                select_by=cfg.rollout.select_by,
                rollout_prefix=f"s{step}",
                concurrency=cfg.rollout.concurrency,
            )
            rollout_s = time.perf_counter() - started
            samples = [s for r in results for s in r.samples]
            trainable, stats = group_advantages(samples, cfg.algorithm)
            started = time.perf_counter()
            update = await asyncio.to_thread(learner.step, trainable) if trainable else {}
            update_s = time.perf_counter() - started
            await asyncio.to_thread(sync.push, step)
            stack.endpoint.policy_version = step

            row = {
                **rollout_metrics(results, rollout_s),
                **sample_metrics(samples),
                **group_metrics(stats),
                **update,
                "time/update_s": update_s,
            }
            if every and step % every == 0 or step == cfg.steps:
                val = await validate(cfg, stack, step)
                row.update(val)
                validations.append({"step": step, **val})
            metrics.log(step, row)
            state = TrainState(step=step, next_task_seed=seeds[-1] + 1)
            if step % cfg.checkpoint.every == 0 or step == cfg.steps:
                await asyncio.to_thread(
                    save_checkpoint, cfg.run_dir, learner, state, cfg, cfg.checkpoint.keep_last
                )
            console.print(_progress_line(step, cfg.steps, row, agents))
    finally:
        await policy.aclose()


def _progress_line(step: int, total: int, row: dict[str, Any], agents: list[str]) -> str:
    rewards = "  ".join(f"{a} {row.get(f'train/reward/{a}', float('nan')):+.2f}" for a in agents)
    val = f"  [bold]val success {row['val/success']:.0%}[/bold]" if "val/success" in row else ""
    return (
        f"step {step}/{total}  success {row['train/success']:.0%}  {rewards}  "
        f"{row['throughput/rollout_tokens_per_s']:.0f} tok/s  "
        f"rollout {row['time/rollout_s']:.1f}s  update {row['time/update_s']:.1f}s{val}"
    )
