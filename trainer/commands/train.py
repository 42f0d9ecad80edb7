"""`masenvs train CONFIG [--set key=value ...] [--resume]`."""

from __future__ import annotations

import argparse
import logging
import os

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from masenvs.adapters.stack import StackError
from masenvs.engine.protocol import BackendError
from masenvs.memory import restart_with_jemalloc
from masenvs.trainer.config import ConfigError, TrainConfig, load_config
from masenvs.trainer.run.checkpoint import list_checkpoints


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="masenvs train", description="Train agents with AT-GRPO from a YAML config."
    )
    parser.add_argument("config", help="YAML file (see examples/quickstart.yaml)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set optim.lr=1e-4 --set rollout.branches=8",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint in run_dir"
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="info logs, and the progress bars of transformers and huggingface_hub (model "
        "conversion, loading, downloads), which masenvs otherwise keeps quiet",
    )
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if args.verbose:  # read where models load: here, in learner ranks and engine processes
        from masenvs.engine.loading import VERBOSE_ENV

        os.environ[VERBOSE_ENV] = "1"
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        handlers=[RichHandler(console=console)],
        format="%(message)s",
    )
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    return run(cfg, console, resume=args.resume)


def run(cfg: TrainConfig, console: Console, resume: bool = False) -> int:
    """Train `cfg` (the one training loop), its errors as one red line: `masenvs train`, and
    the example scripts' workflow command."""
    existing = list_checkpoints(cfg.run_dir)
    if existing and not resume:
        console.print(
            f"[red]{cfg.run_dir} already holds checkpoints (latest {existing[-1].name}): pass "
            "--resume to continue that run, or --set run_dir=... to start a new one[/red]"
        )
        return 2
    cfg.checkpoint.resume = resume
    if cfg.workflow is not None:  # the user's program is checked before torch and the model load
        from masenvs.adapters.frameworks.workflow import check_factory

        try:
            check_factory(cfg.workflow, cfg.env.name, cfg.env.options)
        except (ValueError, TypeError, KeyError) as exc:  # KeyError: an undeclared agent
            console.print(f"[red]{escape(str(exc))}[/red]")
            return 2

    try:  # before torch loads: the allocator must be in place before anything allocates
        restart_with_jemalloc()
    except ValueError as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2

    from masenvs.engine.loading import ModelLoadError
    from masenvs.trainer.rollout.workflow import TooManyFailures
    from masenvs.trainer.run.train import train  # loads torch; keep --help and config errors fast

    try:
        result = train(cfg, console=console)
    except (StackError, ConfigError, BackendError, ModelLoadError) as exc:  # vLLM, a hub id
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    except TooManyFailures as exc:  # workflow runs failing: the most common reason
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 1
    if result.validation:
        first, last = result.validation[0], result.validation[-1]
        console.print(f"validation, step {first['step']} -> step {last['step']}:")
        console.print(f"  success {first['val/success']:.0%} -> {last['val/success']:.0%}")
        for key in sorted(k for k in first if k.startswith("val/reward/") and k in last):
            console.print(
                f"  reward {key.removeprefix('val/reward/')} {first[key]:.3f} -> {last[key]:.3f}"
            )
    return 0
