"""Run a framework workflow from the command line: K runs per task, then training steps.

The example scripts (`examples/langgraph_math.py`, ...) call `main(spec, env, argv)`:

    python examples/langgraph_math.py --model tiny --episodes 2 --branches 2 --train-steps 1

prints every run's reward, the trace summary (calls per agent, the adapter that served
them, call indices) and, per training step, the update's metrics. `--train-steps 0` only
runs the workflow (on the base model).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from masenvs.adapters.frameworks.calls import read_calls
from masenvs.adapters.frameworks.clients import ClientSettings
from masenvs.adapters.frameworks.workflow import Factory, WorkflowRun, WorkflowSpec, check_factory
from masenvs.adapters.policy import Sampling
from masenvs.cache import DEFAULT_MODEL
from masenvs.sampling_args import SamplingArgs
from masenvs.traces import CallRecord
from masenvs.trainer.rollout.workflow import (
    collect_workflow_samples,
    workflow_metrics,
    workflow_policy_map,
)
from masenvs.trainer.samples import Sample


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"{DEFAULT_MODEL} (default), tiny or a path"
    )
    parser.add_argument("--episodes", type=int, default=2, help="tasks (env seeds) per step")
    parser.add_argument(
        "--branches", type=int, default=2, help="K: runs of each task (one advantage group)"
    )
    parser.add_argument("--seed", type=int, default=0, help="first task seed")
    parser.add_argument("--train-steps", type=int, default=1, help="0: rollouts only")
    parser.add_argument("--policy", choices=["per_agent", "shared"], default="per_agent")
    SamplingArgs.add_cli_args(
        parser.add_argument_group("sampling"),
        defaults={"max_tokens": (128, "short answers keep a CPU run of the examples quick")},
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--concurrency", type=int, default=8, help="runs in flight")
    parser.add_argument("--traces", type=Path, help="trace directory (default runs/<name>-*)")
    return parser


def main(
    spec: WorkflowSpec,
    env: str,
    argv: Sequence[str] | None = None,
    *,
    env_options: dict[str, Any] | None = None,
    factory: Factory | None = None,
    description: str = "Run a framework workflow on env tasks and train it.",
) -> int:
    """`factory` (the function itself) spares importing `spec.factory` by its path, which
    only works from the directory that path is relative to."""
    args = build_parser(description).parse_args(argv)
    console = Console()
    # AutoGen logs every failed agent message with a full traceback; the runs table below
    # already names each failure in one line.
    logging.getLogger("autogen_core").setLevel(logging.CRITICAL)
    from masenvs.adapters.stack import StackError, make_backend, start_stack
    from masenvs.trainer.config import TrainConfig

    try:  # a bad factory, env or graph input fails in one line, before any model loads
        factory = check_factory(spec, env, env_options, factory)
    except (ValueError, TypeError, KeyError) as exc:  # KeyError: an undeclared agent
        console.print(f"[red]{exc}[/red]")
        return 2
    traces = args.traces or Path("runs") / f"{env}-{spec.framework}-{time.strftime('%H%M%S')}"
    cfg = TrainConfig(
        run_dir=str(traces.parent),
        steps=max(args.train_steps, 1),
        model={"name": args.model, "device": "cpu"},
        policy={"mode": args.policy},
        lora={"rank": 8, "alpha": 16},
        optim={"lr": args.lr, "warmup_steps": 0},
        rollout={"branches": args.branches, "tasks_per_step": args.episodes},
        validation={"every": 0},
        logging={"tensorboard": False, "entropy": False},
    )
    learner = sync = None
    try:
        with console.status(f"loading {args.model}"):
            backend = make_backend(args.model)
            routes: Any = {}
            if args.train_steps > 0:
                from masenvs.trainer.inference.sync import WeightSync
                from masenvs.trainer.learner.learner import Learner

                learner = Learner(cfg, spec.agents)
                sync = WeightSync(learner, backend, traces / "sync")
                # every agent is served by its own (fresh) adapter
                asyncio.run(sync.push(version=0))
                routes = workflow_policy_map(spec, learner.policy_of)
            stack = start_stack(backend=backend, traces=traces, policy_map=routes)
    except StackError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    settings = ClientSettings(sampling=Sampling.from_cli_args(args))
    try:
        for step in range(1, max(args.train_steps, 1) + 1):
            seeds = list(range(args.seed, args.seed + args.episodes))
            started = time.perf_counter()
            samples, runs = asyncio.run(
                collect_workflow_samples(
                    spec,
                    root_url=stack.root_url,
                    store=stack.store,
                    env_name=env,
                    env_options=env_options,
                    seeds=seeds,
                    branches=args.branches,
                    settings=settings,
                    policy_of=learner.policy_of if learner else None,
                    endpoint=stack.endpoint,
                    step=step,
                    concurrency=args.concurrency,
                    factory=factory,
                )
            )
            console.print(runs_table(runs, step, time.perf_counter() - started))
            calls = read_calls(stack.store, [r.rollout_id for r in runs])
            console.print(trace_table(calls))
            if learner is None:
                continue
            metrics = train_step(learner, samples, cfg)
            asyncio.run(sync.push(version=step))
            stack.endpoint.policy_version = step
            metrics.update(workflow_metrics(runs, samples))
            console.print(metrics_table(metrics, step))
    finally:
        stack.close()
    console.print(f"traces: {traces}")
    return 0


def train_step(learner: Any, samples: list[Sample], cfg: Any) -> dict[str, float]:
    """Group-relative advantages over the K runs, then one learner update."""
    from masenvs.trainer.atgrpo import group_advantages
    from masenvs.trainer.run.metrics import group_metrics, sample_metrics

    trainable, stats = group_advantages(samples, cfg.algorithm)
    update = learner.step(trainable) if trainable else {}
    return {**sample_metrics(samples), **group_metrics(stats), **update}


def runs_table(runs: list[WorkflowRun], step: int, seconds: float) -> Table:
    table = Table(title=f"step {step}: {len(runs)} runs in {seconds:.1f}s")
    for column in ("rollout", "task", "run", "reward", "success", "seconds"):
        table.add_column(column, no_wrap=True)
    table.add_column("answer / error", no_wrap=True, overflow="ellipsis", max_width=32)
    for r in runs:
        shown = Text(r.error, style="red") if r.error else Text(r.answer.replace("\n", " "))
        table.add_row(
            r.rollout_id,
            r.task_id,
            str(r.run_index),
            f"{r.reward:+.3f}",
            "yes" if r.success else "no",
            f"{r.seconds:.1f}",
            shown,
        )
    return table


def trace_table(calls: list[CallRecord]) -> Table:
    """Per agent: calls, the adapters that served them, call indices, tokens."""
    by_agent: dict[str, list[CallRecord]] = defaultdict(list)
    for call in calls:
        by_agent[call.agent].append(call)
    table = Table(title=f"trace: {len(calls)} calls")
    for column in ("agent", "calls", "served by", "call_index", "prompt tok", "completion tok"):
        table.add_column(column)
    for agent, mine in sorted(by_agent.items()):
        indices = sorted({c.call_index for c in mine})
        table.add_row(
            agent,
            str(len(mine)),
            ", ".join(sorted({c.model for c in mine})),
            f"{indices[0]}..{indices[-1]}",
            str(sum(len(c.prompt_token_ids) for c in mine)),
            str(sum(len(ch.token_ids) for c in mine for ch in c.choices)),
        )
    return table


_SHOWN = ("/loss", "/grad_norm", "/samples", "/logprob_diff_mean", "/time_s")


def metrics_table(metrics: dict[str, float], step: int) -> Table:
    """The update's headline numbers (the learner reports many more)."""
    table = Table(title=f"step {step}: update")
    table.add_column("metric")
    table.add_column("value")
    for key in sorted(metrics):
        if key.startswith(("train/", "groups/")) or key.endswith(_SHOWN):
            table.add_row(key, f"{metrics[key]:.4g}")
    return table
