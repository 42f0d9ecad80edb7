"""The example scripts' command line: a framework workflow trained by the one training loop
(`masenvs train`'s), on a config built from a few flags.

The example scripts (`examples/langgraph_math.py`, ...) call `main(spec, env, argv)`:

    python examples/langgraph_math.py --model tiny --tasks-per-step 2 --branches 2 --train-steps 1

is `masenvs train examples/langgraph_math.yaml` in small: each step runs K = `--branches` runs
of `--tasks-per-step` tasks, then one update. The run directory (`--run-dir`) holds the traces,
metrics.jsonl and the checkpoints (`masenvs ui RUN_DIR` shows them).
`masenvs rollout --workflow` runs a workflow without training it.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from masenvs.adapters.frameworks.factory import Factory
from masenvs.adapters.frameworks.workflow import WorkflowSpec
from masenvs.adapters.stack import add_model_arguments
from masenvs.sampling_args import SamplingArgs

if TYPE_CHECKING:
    from masenvs.trainer.config import TrainConfig


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    add_model_arguments(parser, routes=False)
    parser.add_argument("--tasks-per-step", type=int, default=2, help="tasks (env seeds) per step")
    parser.add_argument(
        "--branches", type=int, default=2, help="K: runs of each task (one advantage group)"
    )
    parser.add_argument("--seed", type=int, default=0, help="first task seed")
    parser.add_argument("--train-steps", type=int, default=1, help="training steps (at least 1)")
    parser.add_argument(
        "--policy-mode", choices=["per_agent", "shared"], default="per_agent", help="policy.mode"
    )
    SamplingArgs.add_cli_args(
        parser.add_argument_group("sampling"),
        defaults={"max_tokens": (128, "short answers keep a CPU run of the examples quick")},
    )
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--concurrency", type=int, default=8, help="runs in flight")
    parser.add_argument(
        "--run-dir", type=Path, help="run directory: traces, metrics, checkpoints (runs/<name>-*)"
    )
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
    """`factory`, the script's own function, is imported by its file's path, so the script runs
    from any directory (`spec.factory`'s module path works only from the one it is relative
    to)."""
    args = build_parser(description).parse_args(argv)
    console = Console()
    # AutoGen logs every failed agent message with a full traceback; a failed run is
    # already named in one line.
    logging.getLogger("autogen_core").setLevel(logging.CRITICAL)
    if args.train_steps < 1:
        console.print(
            "[red]--train-steps must be at least 1; `masenvs rollout --workflow` runs a "
            "workflow without training it[/red]"
        )
        return 2
    if factory is not None:
        source = Path(inspect.getsourcefile(factory) or "").resolve()
        spec = spec.model_copy(update={"factory": f"{source}:{factory.__name__}"})
    try:
        cfg = workflow_config(spec, env, env_options or {}, args)
    except ValidationError as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    from masenvs.trainer.commands.train import run

    return run(cfg, console)


def workflow_config(
    spec: WorkflowSpec, env: str, env_options: dict[str, Any], args: argparse.Namespace
) -> TrainConfig:
    """The `TrainConfig` of the flags: a small CPU run of `spec` on `env`, no validation."""
    from masenvs.trainer.config import TrainConfig

    name = f"{env}-{spec.framework}-{time.strftime('%H%M%S')}"
    return TrainConfig(
        run_dir=str(args.run_dir or Path("runs") / name),
        steps=args.train_steps,
        model={"name": args.model, "device": "cpu"},
        env={"name": env, "options": env_options, "seed_start": args.seed},
        workflow=spec,
        policy={"mode": args.policy_mode},
        lora={"rank": 8, "alpha": 16},
        optim={"lr": args.lr, "warmup_steps": 0},
        rollout={
            "branches": args.branches,
            "tasks_per_step": args.tasks_per_step,
            "concurrency": args.concurrency,
            **dataclasses.asdict(SamplingArgs.from_cli_args(args)),
        },
        validation={"every": 0},
        logging={"tensorboard": False, "entropy": False},
    )
