"""`masenvs demos ENV --seeds A:B --out FILE`: solver demonstrations for a supervised cold start.

One JSONL line per agent turn of each seed's episode, in the chat format `masenvs sft` reads
(`masenvs.demos` writes them: hint-free prompts, the exact solver's reply, replayed to success).
Seeds that validation or `masenvs eval` score on are refused: the config's validation seeds
(`--config`) and every seed from eval's default start up.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from masenvs.demos import DemoError, demo_env, episode_demos
from masenvs.trainer.evaluate import DEFAULT_SEED_START

NO_END = 2**63  # the held-out range from DEFAULT_SEED_START has no end


def held_out_seeds(validation: range | None = None) -> list[range]:
    """Seeds no demonstration may use: a config's validation seeds and eval's range."""
    ranges = [range(DEFAULT_SEED_START, NO_END)]
    return ranges + ([validation] if validation is not None else [])


def check_seeds(seeds: range, held_out: list[range]) -> None:
    """Stop with the fix when `seeds` overlaps a held-out range."""
    for held in held_out:
        if seeds.start < held.stop and held.start < seeds.stop:
            where = (
                f"seeds from {held.start} up, which validation and `masenvs eval` draw by default"
                if held.stop >= NO_END
                else f"the config's validation seeds [{held.start}, {held.stop})"
            )
            raise DemoError(
                f"--seeds [{seeds.start}, {seeds.stop}) overlap {where}: demonstrations never "
                f"include validation tasks; pick seeds below {held.start}"
                + (f" or from {held.stop} up" if held.stop < DEFAULT_SEED_START else "")
            )


def demos(
    env_name: str,
    options: dict[str, Any],
    seeds: range,
    held_out: list[range] | None = None,
    explain: bool = False,
    wrong: float = 0.0,
) -> list[dict[str, Any]]:
    """The demonstration lines of every seed's episode; refuses held-out seeds and hints."""
    check_seeds(seeds, held_out_seeds() if held_out is None else held_out)
    env = demo_env(env_name, options, explain, wrong)
    return [row for seed in seeds for row in episode_demos(env, seed, explain, wrong)]


# --- command --------------------------------------------------------------------------------


def parse_seeds(text: str) -> range:
    start, sep, stop = text.partition(":")
    try:
        seeds = range(int(start), int(stop)) if sep else range(int(start), int(start) + 1)
    except ValueError:
        raise DemoError(f"--seeds {text!r}: give A:B (seeds A to B-1), e.g. --seeds 0:64") from None
    if seeds.start < 0 or not seeds:
        raise DemoError(f"--seeds {text!r} holds no seed: give A:B with 0 <= A < B")
    return seeds


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="masenvs demos",
        description="Solver demonstrations (hint-free prompts, correct replies) as JSONL for "
        "`masenvs sft`: one line per agent turn of each seed's episode.",
    )
    parser.add_argument("env", nargs="?", help="plan_path, sudoku or sokoban (or --config)")
    parser.add_argument(
        "--config",
        help="a training YAML: its env, options, rounds and turn order (the prompts its "
        "rollouts send), and its validation seeds held out",
    )
    parser.add_argument("--seeds", required=True, help="task seeds A:B (A to B-1), e.g. 0:64")
    parser.add_argument("--out", required=True, type=Path, help="the JSONL file to write")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="env option"
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="worked answers: each reply states what it reads off the board before its "
        "answer (plan-path: where A and G are and the offset, then `#### [moves]`; Sudoku: for "
        "each empty cell a full row, column or box and the digit it lacks, then the fills)",
    )
    parser.add_argument(
        "--wrong-proposals",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="plan-path with tool_task: propose: in this share of the episodes the plan agent "
        "reads a wrong move list from the tool (one move changed, dropped or added; the tool's "
        "line is still the solver's answer) and still answers right, so it learns to read the "
        "board rather than copy the proposal",
    )
    return parser


def _env_and_options(args: argparse.Namespace) -> tuple[str, dict[str, Any], range | None]:
    from masenvs.overrides import parse_overrides

    if args.config is None:
        if args.env is None:
            raise DemoError("name the environment (plan_path, sudoku, sokoban) or give --config")
        return args.env, parse_overrides(args.set), None
    from masenvs.trainer.config import load_config
    from masenvs.trainer.rollout.sources import env_options

    cfg = load_config(args.config)
    if args.env not in (None, cfg.env.name):
        raise DemoError(f"{args.config} trains {cfg.env.name}, not {args.env}: drop one")
    options = {**env_options(cfg), **parse_overrides(args.set)}
    return cfg.env.name, options, cfg.validation_seeds()


def main(argv: list[str]) -> int:
    from rich.console import Console

    args = build_parser().parse_args(argv)
    console = Console()
    try:
        env_name, options, validation = _env_and_options(args)
        seeds, held_out = parse_seeds(args.seeds), held_out_seeds(validation)
        rows = demos(env_name, options, seeds, held_out, args.explain, args.wrong_proposals)
    except (ValueError, TypeError, KeyError) as exc:  # DemoError, ConfigError, env options
        console.print(str(exc), style="red", markup=False)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    seeds = len({row["seed"] for row in rows})
    console.print(
        f"demos: {len(rows)} agent turns of {seeds} {env_name} episodes, each replayed to "
        f"success; wrote {args.out}\nfine-tune on them: masenvs sft CONFIG {args.out}"
    )
    return 0
