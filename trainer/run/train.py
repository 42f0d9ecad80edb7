"""The AT-GRPO training loop: rollout -> advantages -> update -> weight sync, step after step.

Everything runs in one process tree: the learner (peft LoRA), the inference backend behind
the capture endpoint, and the env rollouts. `train(cfg)` is what `masenvs train` calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from masenvs.adapters.policy_map import PolicyMap
from masenvs.adapters.stack import Stack, start_stack
from masenvs.listeners import API_KEY_ENV, announce, listener_key
from masenvs.memory import allocator_note, release_free_memory, tune_allocator
from masenvs.trainer.atgrpo import group_advantages
from masenvs.trainer.config import ConfigError, TrainConfig, save_config
from masenvs.trainer.inference.engines import open_inference
from masenvs.trainer.inference.plan import InferencePlan, inference_plan
from masenvs.trainer.inference.sync import WeightSync
from masenvs.trainer.learner.dist_learner import make_learner
from masenvs.trainer.learner.flops import mfu_metrics
from masenvs.trainer.learner.learner import Learner
from masenvs.trainer.learner.policies import resolve_device
from masenvs.trainer.rollout import sources
from masenvs.trainer.run.checkpoint import (
    TrainState,
    load_latest,
    resume_warning,
    rl_start,
    save_checkpoint,
)
from masenvs.trainer.run.metrics import (
    MetricsLogger,
    group_metrics,
    moves_line,
    read_metrics,
    sample_metrics,
    schedule_warning,
    step_warnings,
    validation_warning,
    weight_moves,
    weight_snapshot,
)
from masenvs.trainer.run.plots import plot_curves
from masenvs.trainer.run.steplog import SAMPLES_FILE, write_step_samples
from masenvs.trainer.samples import Sample

log = logging.getLogger(__name__)


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


def endpoint_binding(cfg: TrainConfig) -> tuple[str, str | None]:
    """Where the capture endpoint listens and the key it requires.

    Rollout workers in a Ray cluster reach it from other nodes, so it binds all interfaces
    (or `distributed.endpoint_host`); beyond loopback it needs a key: $MASENVS_API_KEY, else
    one generated for this run (the workers get it through Ray, in their spec), unless
    `distributed.endpoint_no_auth` opens it on purpose.
    """
    dist = cfg.distributed
    remote = dist.ray_address and dist.rollout_workers
    host = dist.endpoint_host or ("0.0.0.0" if remote else "127.0.0.1")
    key = listener_key(
        host,
        os.environ.get(API_KEY_ENV),
        what="the trainer's capture endpoint (it records calls as training data)",
        no_auth=dist.endpoint_no_auth,
        generate=True,
        open_flag="distributed.endpoint_no_auth=true",
    )
    return host, key


def listening_lines(stack: Stack) -> list[str]:
    """One line per address this run listens on (the endpoint, engines it started), and
    whether a key protects it; never the key."""
    lines = [announce("capture endpoint", stack.root_url, stack.api_key)]
    seen, backends = set(), [stack.backend]
    while backends:
        backend = backends.pop()
        if id(backend) in seen:
            continue
        seen.add(id(backend))
        url = getattr(backend, "url", None)
        if isinstance(url, str) and url.startswith("http"):
            lines.append(announce("engine", url, getattr(backend, "api_key", None)))
        backends += [getattr(e, "backend", e) for e in getattr(backend, "engines", ())]
        backends += list(getattr(backend, "backends", ()))
    return lines


def train(cfg: TrainConfig, *, console: Console | None = None) -> TrainResult:
    """Run (or resume, with `cfg.checkpoint.resume`) the training described by `cfg`."""
    console = console or Console()
    # Before any model loads: jemalloc where `masenvs train` restarted with it, else large
    # tensors get their own mappings, freed back to the system (docs/memory.md).
    tune_allocator()
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    agents = run_agents(cfg)
    # The run's inference, decided once from the config: a misfit fails before models load.
    plan = inference_plan(cfg, agents, device=str(resolve_device(cfg.model.device)))
    warning = schedule_warning(cfg)
    if warning is not None:
        _warn(console, warning)
    with _status(
        console, f"loading {cfg.model.name} for the learner (allocator: {allocator_note()})"
    ):
        learner = make_learner(cfg, agents)  # in this process, or on learner ranks
    state = TrainState(step=0, next_task_seed=cfg.env.seed_start)
    checkpoint = load_latest(run_dir) if cfg.checkpoint.resume else None
    if checkpoint is not None:
        state = rl_start(checkpoint.restore(learner), cfg)
        console.print(f"resumed from {checkpoint.path} (step {state.step})")
        if (warning := resume_warning(state, cfg)) is not None:
            console.print(escape(warning), style="yellow")
    save_config(cfg, run_dir / "config.yaml")

    with _status(console, f"starting the {cfg.backend.kind} backend"):
        stack, sync = serve_run(cfg, plan, learner, state.step)
    for line in listening_lines(stack):
        console.print(escape(line))
    metrics = MetricsLogger(
        run_dir, cfg.logging, cfg, resume_step=state.step if checkpoint is not None else -1
    )
    source_class = sources.WorkflowSource if cfg.workflow is not None else sources.TreeSource
    start = weight_snapshot(learner)
    try:
        asyncio.run(_loop(cfg, learner, stack, sync, metrics, source_class, state, console))
        if start:
            console.print(moves_line(weight_moves(learner, start)))
    finally:
        metrics.close()
        stack.close()
        getattr(learner, "close", lambda: None)()  # a distributed learner's ranks stop
    plot = plot_curves(
        run_dir / "metrics.jsonl", run_dir / "curves.png", title=f"{cfg.env.name}: AT-GRPO"
    )
    console.print(f"curves: {plot}\nmetrics: {run_dir / 'metrics.jsonl'}")
    validations = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val/success" in r]
    return TrainResult(run_dir, cfg.steps, validations, plot)


def run_agents(cfg: TrainConfig) -> list[str]:
    """The agents this run trains and serves: the workflow's, else the env's (and the ones
    its programs call); a bad env, factory, graph input or agent name fails here, in one
    line, before models load."""
    if cfg.workflow is not None:
        from masenvs.adapters.frameworks.clients import UnknownAgent
        from masenvs.adapters.frameworks.workflow import check_factory
        from masenvs.trainer.rollout.workflow import UnknownAgentError

        agents = list(cfg.workflow.agents)
        try:
            check_factory(cfg.workflow, cfg.env.name, cfg.env.options)
        except UnknownAgent as exc:
            raise UnknownAgentError(f"factory {cfg.workflow.factory!r}: {exc}") from exc
        except (ValueError, TypeError) as exc:
            raise ConfigError(str(exc)) from exc
    else:
        env = sources.env_factory(cfg)()
        agents = list(dict.fromkeys([*env.possible_agents, *env.callers]))
    sources.agent_sampling(cfg, agents)
    off = sorted(set(cfg.schedule.alternate) - set(agents))
    if off:
        raise ConfigError(
            f"schedule.alternate names {off[0]!r}, not an agent of this run ({', '.join(agents)})"
        )  # a misspelt agents.<name> fails here, before models load
    return agents


def serve_run(
    cfg: TrainConfig, plan: InferencePlan, learner: Learner, step: int
) -> tuple[Stack, WeightSync]:
    """The run's inference opened from `plan`, holding the learner's weights of `step`,
    behind the capture endpoint; and the `WeightSync` that keeps it current."""
    backend = open_inference(plan, Path(cfg.run_dir))
    try:
        sync = WeightSync(learner, backend, Path(cfg.run_dir) / "sync")
        asyncio.run(sync.push(version=step))
        host, api_key = endpoint_binding(cfg)
        stack = start_stack(
            backend=backend,
            traces=Path(cfg.run_dir) / "traces",
            policy_map=policy_map(cfg, plan),
            host=host,
            api_key=api_key,
        )
    except BaseException:
        getattr(backend, "shutdown", lambda: None)()  # a vLLM started here stops too
        raise
    stack.endpoint.policy_version = step
    return stack, sync


def policy_map(cfg: TrainConfig, plan: InferencePlan) -> PolicyMap:
    """The endpoint's routes: each agent to the model its plan serves it as (a workflow's
    other model names too: its unknown_agents)."""
    kwargs = {agent: cfg.agent(agent).chat_template_kwargs for agent in plan.models}
    if cfg.workflow is None:
        return PolicyMap(dict(plan.models), chat_template_kwargs=kwargs)
    from masenvs.trainer.rollout.workflow import workflow_policy_map

    return workflow_policy_map(cfg.workflow, plan.models.__getitem__, kwargs)


async def _loop(
    cfg: TrainConfig,
    learner: Learner,
    stack: Stack,
    sync: WeightSync,
    metrics: MetricsLogger,
    source_class: type[sources.TreeSource] | type[sources.WorkflowSource],
    state: TrainState,
    console: Console,
) -> None:
    source = source_class(cfg, stack, learner)
    every = cfg.validation.every
    try:
        if every and state.step == 0:
            await _validate_first(source, metrics, console)
        clock = _RunClock(state.step, cfg.steps)  # the steps' pace, validation's not in it
        for step in range(state.step + 1, cfg.steps + 1):
            seeds = list(
                range(state.next_task_seed, state.next_task_seed + cfg.rollout.tasks_per_step)
            )
            started = time.perf_counter()
            with _rollout_progress(console, stack, step, clock):
                samples, row = await source.collect(step, seeds)
            rollout_s = clock.rollout_s = time.perf_counter() - started
            release_free_memory()  # the rollout's freed blocks, before the update's peak
            trained = [s for s in samples if learner.trains(s.policy)]  # frozen agents: none
            trained = [s for s in trained if cfg.schedule.scale(step, s.agent) > 0]
            trainable, stats = group_advantages(trained, cfg.algorithm)
            if not trainable:  # say why instead of an update over nothing
                why = _why_no_update(source, samples, trained, cfg.schedule.phase(step))
                _warn(console, f"step {step}/{cfg.steps}: no trainable sample, no update: {why}")
            lr_scale = _schedule_lr(cfg, learner, step, trainable)
            started = time.perf_counter()
            # The update runs on this thread: a worker thread would keep a second torch thread
            # pool that competes with the engine's once the next rollout starts.
            with _status(console, f"step {step}/{cfg.steps} update: {len(trainable)} samples"):
                update = learner.step(trainable, lr_scale=lr_scale) if trainable else {}
            update_s = time.perf_counter() - started
            release_free_memory()  # the update's activations, before validation and the rollout
            if cfg.logging.mfu and update.get("learner/gflop_per_s"):
                update.update(mfu_metrics(update))
            # what the step did with each sample, for `masenvs ui` (after the update: the
            # learner's log-probs are in it)
            write_step_samples(Path(cfg.run_dir) / SAMPLES_FILE, step, samples, trained, trainable)
            await sync.push(step)
            stack.endpoint.policy_version = step

            tokens = sum(len(s.completion_token_ids) for s in samples)
            row.update(sample_metrics(samples))
            row.update(group_metrics(stats))
            row.update(update)
            if cfg.schedule.alternate:
                row["schedule/phase"] = float(
                    cfg.schedule.alternate.index(cfg.schedule.phase(step))
                )
            row["time/rollout_s"] = rollout_s
            row["time/update_s"] = update_s
            row["throughput/rollout_tokens_per_s"] = tokens / max(rollout_s, 1e-9)
            if every and (step % every == 0 or step == cfg.steps):
                with _validation_progress(console, f"step {step} validation") as progress:
                    row.update(await source.validate(step, progress))
            metrics.log(step, row)
            state = TrainState(step=step, next_task_seed=seeds[-1] + 1)
            if step % cfg.checkpoint.every == 0 or step == cfg.steps:
                await asyncio.to_thread(
                    save_checkpoint, cfg.run_dir, learner, state, cfg, cfg.checkpoint.keep_last
                )
            clock.step_done()
            line = _progress_line(step, cfg.steps, row, learner.agents)
            console.print(f"{line}  {clock.eta()}".rstrip())
            for warning in step_warnings(step, row, cfg, trained=bool(trainable)):
                _warn(console, warning)
            if (warning := validation_warning(step, row)) is not None:
                _warn(console, warning)
    finally:
        await source.aclose()


async def _validate_first(source: Any, metrics: MetricsLogger, console: Console) -> None:
    """Step 0's validation: the untrained policies' success, the baseline of the run."""
    with _validation_progress(console, "validating before training") as progress:
        val = await source.validate(0, progress)
    metrics.log(0, val)
    console.print(f"step 0 validation: success {val['val/success']:.0%}")
    if (warning := validation_warning(0, val)) is not None:
        _warn(console, warning)


class _RunClock:
    """The run's ETA, from the mean wall time of the steps done so far in this process."""

    def __init__(self, first_step: int, total: int) -> None:
        self.done, self.total, self.left = 0, total, total - first_step
        self.started = time.perf_counter()
        self.rollout_s: float | None = None  # the last step's rollout, the next one's guess

    def step_done(self) -> None:
        self.done += 1
        self.left -= 1

    def eta(self) -> str:
        """`run ETA 4 min 10 s` once a step has been timed; '' before, or at the end."""
        if not self.done or not self.left:
            return ""
        seconds = (time.perf_counter() - self.started) / self.done * self.left
        return f"run ETA {_duration(seconds)}"


def _duration(seconds: float) -> str:
    """`42 s`, `4 min 10 s`, `1 h 5 min`."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def _schedule_lr(
    cfg: TrainConfig, learner: Learner, step: int, samples: list[Sample]
) -> dict[str, float] | None:
    """'lr' schedule: a policy that only off-phase roles use trains at `off_lr_scale` of its
    learning rate; in a policy shared with the phase's role, the off-phase roles' samples
    have their advantages scaled instead (one optimizer cannot take two learning rates)."""
    if cfg.schedule.mode != "lr" or not cfg.schedule.alternate:
        return None
    scales: dict[str, set[float]] = defaultdict(set)
    for agent in learner.agents:
        scales[learner.policy_of(agent)].add(cfg.schedule.scale(step, agent))
    out = {}
    for policy, values in scales.items():
        if len(values) == 1:
            out[policy] = values.pop()
    for s in samples:
        if s.policy not in out and s.advantage is not None:
            s.advantage *= cfg.schedule.scale(step, s.agent)
    return out


def _why_no_update(
    source: Any, samples: list[Sample], trained: list[Sample], phase: str | None
) -> str:
    if not samples:
        return source.why_no_samples()
    if not trained:
        if phase is not None:
            return f"no sample of a frozen agent or of {phase!r}, whose phase this is (schedule)"
        return "every sample is a frozen agent's"
    return "algorithm.drop_zero_std_groups / keep_top_groups dropped every group"


def _progress_line(step: int, total: int, row: dict[str, Any], agents: list[str]) -> str:
    rewards = "  ".join(
        f"{a} {row[f'train/reward/{a}']:+.2f}" if f"train/reward/{a}" in row else f"{a} -"
        for a in agents
    )
    val = f"  [bold]val success {row['val/success']:.0%}[/bold]" if "val/success" in row else ""
    return (
        f"step {step}/{total}  success {row['train/success']:.0%}  {rewards}  "
        f"{_update_figures(row)}  {row['throughput/rollout_tokens_per_s']:.0f} tok/s  "
        f"rollout {row['time/rollout_s']:.1f}s  update {row['time/update_s']:.1f}s{val}"
    )


def _status(console: Console, text: str) -> Any:
    """A spinner on a terminal; in a log, the line itself (a log is never silent for the
    minutes a model takes to load on a CPU)."""
    if not console.is_terminal:
        console.print(f"{time.strftime('%H:%M:%S')} {text}")
    return console.status(text)


def _warn(console: Console, text: str) -> None:
    """A run that cannot learn says so, on the console the progress lines go to."""
    console.print(f"[yellow]warning:[/yellow] {escape(text)}")


def _update_figures(row: dict[str, Any]) -> str:
    """lr, loss, grad norm and the learner's distance to the sampler, averaged over the
    policies updated: `lr 1e-05 loss -0.012 gnorm 0.31 ratio 1.000 |dlogp| 0.004`."""
    if "learner/lr" not in row:
        return "no update"

    def mean(name: str) -> float | None:
        values = [v for k, v in row.items() if k.startswith("learner/") and k.endswith(name)]
        return sum(values) / len(values) if values else None

    figures = [f"lr {row['learner/lr']:.2g}"]
    for label, name, fmt in (
        ("loss", "/loss", ".3g"),
        ("gnorm", "/grad_norm", ".3g"),
        ("ratio", "/ratio_mean", ".3f"),
        ("|dlogp|", "/logprob_diff_mean", ".3g"),
    ):
        value = mean(name)
        if value is not None:
            figures.append(f"{label} {value:{fmt}}")
    return " ".join(figures)


@contextlib.contextmanager
def _validation_progress(console: Console, text: str) -> Iterator[Progress]:
    """Validation's bar with an ETA on a terminal; in a log, its first line now, then a line
    per episode (the bar is off there: a log gets lines, never a bar's dump)."""
    if not console.is_terminal:
        console.print(f"{time.strftime('%H:%M:%S')} {text}")
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(
        *columns, TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        console=console, transient=True, disable=not console.is_terminal,
    ) as progress:  # fmt: skip
        yield progress


@contextlib.contextmanager
def _rollout_progress(
    console: Console, stack: Stack, step: int, clock: _RunClock
) -> Iterator[None]:
    """Calls, tokens and tokens/s of the rollout under way, from its first call: a spinner
    on a terminal; in a log, a line as it starts, then one every 30 s (the first step can
    take minutes on a CPU). Its ETA is the last step's rollout time, the run's from the
    steps done."""
    endpoint = stack.endpoint
    calls0, tokens0, started = endpoint.calls_done, endpoint.tokens_done, time.perf_counter()
    stop = threading.Event()

    def figures() -> str:
        calls, tokens = endpoint.calls_done - calls0, endpoint.tokens_done - tokens0
        seconds = time.perf_counter() - started
        guess, run = clock.rollout_s, clock.eta()
        eta = f", ETA {_duration(guess - seconds)}" if guess and guess > seconds else ""
        done = f"{calls} calls, {tokens} tokens, {tokens / max(seconds, 1e-9):.0f} tok/s, "
        head = f"step {step}/{clock.total} rollout: {done if calls else ''}{seconds:.0f}s"
        return head + eta + (f"; {run}" if run else "")

    def tick(status: Any) -> None:
        last = time.perf_counter()
        while not stop.wait(1.0):
            if status is not None:
                status.update(figures())
            elif time.perf_counter() - last >= 30.0:
                last = time.perf_counter()
                console.print(figures())

    if not console.is_terminal:
        console.print(f"{time.strftime('%H:%M:%S')} {figures()}")
    status = console.status(figures()) if console.is_terminal else None
    thread = threading.Thread(target=tick, args=(status,), name="masenvs-progress", daemon=True)
    with status if status is not None else contextlib.nullcontext():
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
