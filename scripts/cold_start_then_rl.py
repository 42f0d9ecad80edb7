"""Cold start from solver demonstrations, then AT-GRPO, beside the SFT-continued control (issue 46).

    python scripts/cold_start_then_rl.py --seed 0 --out runs/cold-s0            # one seed
    python scripts/cold_start_then_rl.py --seed 1 --out runs/cold-s1 --sft-from runs/cold-s0/sft
    python scripts/cold_start_then_rl.py --smoke --out /tmp/cold                # tiny model, ~2 min

Each step is the `masenvs` command a user would type (printed as it starts), run in this process:
  1. demos:  masenvs demos --config CONFIG --seeds A:B --out OUT/demos.jsonl
  2. sft:    masenvs sft CONFIG OUT/demos.jsonl --set run_dir=OUT/sft   (few demonstrations and
             epochs: a weak cold start on purpose, so that RL has room). With --sft-from RUN,
             steps 1-2 are skipped and RUN's SFT checkpoint is the cold start (one SFT, several
             RL seeds).
  3. eval:   masenvs eval --checkpoint OUT/sft --temperature 0          (greedy, validation seeds)
  4. train:  masenvs train CONFIG --resume --set run_dir=OUT/rl          (AT-GRPO from the SFT
             weights: OUT/rl starts as a copy of the SFT checkpoint)
  5. eval:   the RL checkpoint, greedy
  6. control: the SFT checkpoint's training continued on the same demonstrations for about RL's
             wall time (`sft --init-from`, whole epochs, in OUT/sft_continued), greedy eval
  7. control: RL from the base model with the same recipe (OUT/rl_from_base), greedy eval;
             --no-base skips it
Writes OUT/summary.json and prints the greedy success of each checkpoint. docs/learning.md
gives the table these runs made.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path

from masenvs.cli import main as masenvs

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "learning" / "cold_start_plan_path.yaml"
CHECKPOINT_0 = Path("checkpoints") / "step_00000000"
# Seed S trains on the tasks from S * SEED_STRIDE on: seeds that share a cold start differ in
# their tasks, not only in their samples (below the demonstrations' and validation's seeds).
SEED_STRIDE = 10_000

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


def sft_record(run: Path) -> dict | None:
    """The `sft` record of a run's checkpoint 0 (or of a step folder): data, epochs, lr, seconds,
    init_from; None for a checkpoint that SFT did not write."""
    for state in (run / CHECKPOINT_0 / "state.json", run / "state.json"):
        if state.is_file():
            return json.loads(state.read_text())["extra"].get("sft")
    return None


def epochs_in_all(record: dict | None) -> int:
    """Epochs of SFT behind a checkpoint, following `sft --init-from` back to the first."""
    total = 0
    while record is not None:
        total += record["epochs"]
        record = sft_record(Path(record["init_from"])) if "init_from" in record else None
    return total


def sft_run(args: argparse.Namespace, out: Path, flags: list[str]) -> tuple[Path, Path, dict]:
    """The cold start: OUT/sft written here (demos, then sft), or --sft-from's. Returns the SFT
    run, its demonstrations and the sft record of its checkpoint (data, epochs, lr, seconds)."""
    if args.sft_from is None:
        demos = out / "demos.jsonl"
        seeds = f"{args.demo_seeds}:{args.demo_seeds + args.demos}"
        explain = [] if args.plain else ["--explain"]
        if args.wrong_proposals:
            explain += ["--wrong-proposals", str(args.wrong_proposals)]
        run(
            ["demos", "--config", str(args.config), "--seeds", seeds, "--out", str(demos), *explain]
        )
        sft = out / "sft"
        recipe = ["--epochs", str(args.sft_epochs), "--lr", str(args.sft_lr), "--batch-size", "4"]
        run(["sft", str(args.config), str(demos), *flags, "--set", f"run_dir={sft}", *recipe])
    else:
        sft = Path(args.sft_from)
    record = sft_record(sft)
    if record is None:
        raise SystemExit(f"{sft} holds no SFT checkpoint 0: pass an `masenvs sft` run")
    return sft, Path(record["data"][0]), record


def pipeline(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = str(args.config)
    seeds = [f"seed={args.seed}", f"env.seed_start={args.seed * SEED_STRIDE}"]
    sets = [*(SMOKE_SETS if args.smoke else []), *seeds, *args.set]
    flags = [x for s in sets for x in ("--set", s)]
    sft, demos, record = sft_run(args, out, flags)
    if args.sft_eval:  # the same checkpoint's eval from an earlier seed: the same tasks
        shutil.copyfile(args.sft_eval, out / "eval_sft.json")
        before = float(json.loads(args.sft_eval.read_text())["results"][0]["avg"])
    else:
        before = greedy_eval(sft, out / "eval_sft.json", args.eval_tasks)

    rl = out / "rl"
    shutil.copytree(sft / CHECKPOINT_0, rl / CHECKPOINT_0)
    rl_seconds = run(["train", config, "--resume", *flags, "--set", f"run_dir={rl}"])
    after = greedy_eval(rl, out / "eval_rl.json", args.eval_tasks)

    success = {"sft": before, "rl": after}
    seconds = {"sft": record["seconds"], "rl": rl_seconds}
    epochs = {"sft": epochs_in_all(record)}
    if not args.no_control:
        # The control: the SFT checkpoint trained on for about RL's wall time, in whole epochs
        # of the first SFT (whose seconds include loading the model: at least one epoch).
        extra = max(1, round(rl_seconds / (record["seconds"] / record["epochs"])))
        control = out / "sft_continued"
        more = ["--epochs", str(extra), "--lr", str(record["lr"]), "--batch-size", "4"]
        more += ["--init-from", str(sft)]
        more += ["--set", f"run_dir={control}"]
        seconds["sft_continued"] = run(["sft", config, str(demos), *flags, *more])
        success["sft_continued"] = greedy_eval(
            control, out / "eval_sft_continued.json", args.eval_tasks
        )
        epochs["sft_continued"] = epochs["sft"] + extra
    if not args.no_base:  # RL from the base model, the same recipe and seed (issue 33)
        base = out / "rl_from_base"
        seconds["rl_from_base"] = run(["train", config, *flags, "--set", f"run_dir={base}"])
        success["rl_from_base"] = greedy_eval(base, out / "eval_rl_from_base.json", args.eval_tasks)

    summary = {
        "config": config,
        "seed": args.seed,
        "smoke": args.smoke,
        "sft_run": str(sft),
        "demos": str(demos),
        "greedy_success": success,
        "seconds": seconds,
        "sft_epochs": epochs,
        "eval_tasks": args.eval_tasks,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG, help="the training YAML")
    parser.add_argument("--out", default="runs/cold_start", help="folder of the runs and evals")
    parser.add_argument(
        "--seed", type=int, default=0, help="run seed (LoRA init, shuffles, RL, training tasks)"
    )
    parser.add_argument("--demos", type=int, default=160, help="demonstration episodes")
    parser.add_argument(
        "--demo-seeds", type=int, default=200_000, help="first demo task seed (not validation's)"
    )
    parser.add_argument("--sft-epochs", type=int, default=2, help="few: a weak cold start")
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--eval-tasks", type=int, default=64, help="greedy eval tasks")
    parser.add_argument(
        "--sft-from", metavar="RUN", help="an earlier seed's OUT/sft: its cold start, no new SFT"
    )
    parser.add_argument(
        "--wrong-proposals",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="plan-path: that share of the demonstrations show the plan a wrong tool proposal "
        "(`masenvs demos --wrong-proposals`; 0.5 gave the 3-seed result in docs/learning.md)",
    )
    parser.add_argument(
        "--sft-eval",
        type=Path,
        metavar="JSON",
        help="with --sft-from: that checkpoint's greedy eval from an earlier seed, reused",
    )
    parser.add_argument("--no-base", action="store_true", help="skip RL from the base model")
    parser.add_argument("--no-control", action="store_true", help="skip the SFT-continued control")
    parser.add_argument(
        "--plain", action="store_true", help="answers alone, not worked (no demos --explain)"
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--smoke", action="store_true", help="the tiny model, one step each: checks the wiring"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sft_eval and not args.sft_from:
        parser.error("--sft-eval reuses the eval of the checkpoint --sft-from names: pass both")
    if args.wrong_proposals and args.sft_from:
        parser.error("--wrong-proposals writes new demonstrations; --sft-from reuses a cold start")
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
