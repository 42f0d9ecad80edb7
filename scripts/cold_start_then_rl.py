"""Cold start from solver demonstrations, then AT-GRPO, beside the SFT-continued control (issue 46).

    python scripts/cold_start_then_rl.py --seed 0 --out runs/cold     # one seed of the table
    python scripts/cold_start_then_rl.py --smoke --out /tmp/cold      # the tiny model, ~2 min

Each step is the `masenvs` command a user would type (printed as it starts), run in this process:
  1. demos:  masenvs demos --config CONFIG --seeds A:B --out OUT/demos.jsonl
  2. sft:    masenvs sft CONFIG OUT/demos.jsonl --set run_dir=OUT/rl   (checkpoint 0 of the RL run;
             few demonstrations and epochs: a weak cold start on purpose, so that RL has room)
  3. eval:   masenvs eval --checkpoint OUT/rl --temperature 0            (greedy, validation seeds)
  4. train:  masenvs train CONFIG --resume --set run_dir=OUT/rl          (AT-GRPO from the SFT weights)
  5. eval:   the RL checkpoint, greedy
  6. control: the same SFT continued for about RL's wall time (more epochs, the same data and
             shuffles, in OUT/sft_continued), greedy eval
  7. control: RL from the base model with the same recipe (OUT/rl_from_base), greedy eval
Writes OUT/summary.json and prints the greedy success of the four checkpoints. The learning
table (3 seeds, docs/learning.md) is made of these runs; it is not measured yet.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from masenvs.cli import main as masenvs

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "learning" / "cold_start_plan_path.yaml"

# --smoke: the tiny random model, one step of everything, so the whole pipeline runs in minutes.
SMOKE_SETS = [
    "model.name=tiny",
    "steps=1",
    "rollout.tasks_per_step=1",
    "rollout.branches=2",
    "rollout.max_tokens=8",
    "validation.every=0",
    "validation.episodes=2",
    "checkpoint.every=1",
    "logging.plot_every=0",
    "optim.warmup_steps=0",
    "algorithm.drop_zero_std_groups=false",  # the one RL step updates even when all fail
]


def run(argv: list[str]) -> float:
    """One masenvs command, printed as typed; its wall seconds. A failure stops the pipeline."""
    print(f"\n$ masenvs {shlex.join(argv)}", flush=True)
    started = time.perf_counter()
    code = masenvs(argv)
    if code != 0:
        raise SystemExit(f"`masenvs {argv[0]}` failed (exit {code}); see its message above")
    return time.perf_counter() - started


def greedy_eval(checkpoint: Path, out: Path, tasks: int) -> float:
    """Greedy success (avg@1) of a run's latest checkpoint on its validation seeds."""
    run(["eval", "--checkpoint", str(checkpoint), "--temperature", "0", "--tasks", str(tasks)]
        + ["--out", str(out)])  # fmt: skip
    return float(json.loads(out.read_text())["results"][0]["avg"])


def pipeline(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    config = str(args.config)
    sets = [*(SMOKE_SETS if args.smoke else []), f"seed={args.seed}", *args.set]
    flags = [x for s in sets for x in ("--set", s)]
    demos = out / "demos.jsonl"
    seeds = f"{args.demo_seeds}:{args.demo_seeds + args.demos}"
    run(["demos", "--config", config, "--seeds", seeds, "--out", str(demos)])

    sft = ["--epochs", str(args.sft_epochs), "--lr", str(args.sft_lr), "--batch-size", "4"]
    rl, control = out / "rl", out / "sft_continued"
    sft_seconds = run(["sft", config, str(demos), *flags, "--set", f"run_dir={rl}", *sft])
    before = greedy_eval(rl, out / "eval_sft.json", args.eval_tasks)
    rl_seconds = run(["train", config, "--resume", *flags, "--set", f"run_dir={rl}"])
    after = greedy_eval(rl, out / "eval_rl.json", args.eval_tasks)

    # The control: the same SFT (same data, seed and shuffles) continued for about RL's wall
    # time, measured in epochs of the first SFT (whose time includes loading the model: the
    # control gets at least one more epoch, and at most that much less than RL's time).
    extra = max(1, round(rl_seconds / (sft_seconds / args.sft_epochs)))
    more = ["--epochs", str(args.sft_epochs + extra), *sft[2:]]
    control_seconds = run(["sft", config, str(demos), *flags, "--set", f"run_dir={control}", *more])
    continued = greedy_eval(control, out / "eval_sft_continued.json", args.eval_tasks)
    # RL from the base model, the same recipe and seed (issue 33's result on this task).
    base = out / "rl_from_base"
    base_seconds = run(["train", config, *flags, "--set", f"run_dir={base}"])
    from_base = greedy_eval(base, out / "eval_rl_from_base.json", args.eval_tasks)

    summary = {
        "config": config,
        "seed": args.seed,
        "smoke": args.smoke,
        "demos": {"file": str(demos), "seeds": seeds},
        "greedy_success": {
            "sft": before,
            "rl": after,
            "sft_continued": continued,
            "rl_from_base": from_base,
        },
        "seconds": {
            "sft": sft_seconds,
            "rl": rl_seconds,
            "sft_continued": control_seconds,
            "rl_from_base": base_seconds,
        },
        "sft_epochs": {"sft": args.sft_epochs, "sft_continued": args.sft_epochs + extra},
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG, help="the training YAML")
    parser.add_argument("--out", default="runs/cold_start", help="folder of the runs and evals")
    parser.add_argument("--seed", type=int, default=0, help="run seed (LoRA init, shuffles, RL)")
    parser.add_argument("--demos", type=int, default=32, help="demonstration episodes")
    parser.add_argument(
        "--demo-seeds", type=int, default=200_000, help="first demo task seed (not validation's)"
    )
    parser.add_argument("--sft-epochs", type=int, default=2, help="few: a weak cold start")
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--eval-tasks", type=int, default=32, help="greedy eval tasks")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--smoke", action="store_true", help="the tiny model, one step each: checks the wiring"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        args.demos, args.sft_epochs, args.eval_tasks = 4, 1, 2
    summary = pipeline(args)
    print("\ngreedy validation success (avg@1):")
    for name, value in summary["greedy_success"].items():
        seconds = summary["seconds"].get(name, 0.0)
        print(f"  {name:<14} {value:6.1%}   ({seconds:.0f} s)")
    if args.smoke:
        print("(smoke run: the tiny random model; these numbers say nothing about learning)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
