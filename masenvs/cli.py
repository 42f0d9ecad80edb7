"""The `masenvs` command: list and play environments; rollout, serve and train live in their
own modules and are imported only when used."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from masenvs.overrides import parse_overrides
from masenvs.registry import env_class, list_bridges, list_envs, make

# command -> "module:function" taking argv and returning an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "rollout": ("masenvs.adapters.rollout:main", "run episodes with an LLM policy, write traces"),
    "serve": (
        "masenvs.adapters.serve:main",
        "serve a (trained) policy as an OpenAI-compatible API",
    ),
    "train": (
        "masenvs.trainer.commands.train:main",
        "train agents with AT-GRPO from a YAML config",
    ),
    "sft": (
        "masenvs.trainer.commands.sft:main",
        "supervised fine-tuning on chat traces (JSONL) as checkpoint 0 of a run (cold start)",
    ),
    "demos": (
        "masenvs.trainer.commands.demos:main",
        "solver demonstrations (hint-free prompts, correct replies) as JSONL for `masenvs sft`",
    ),
    "eval": (
        "masenvs.trainer.commands.eval:main",
        "avg@k and pass@k of base models, checkpoints and OpenAI URLs, side by side",
    ),
    "mas-graph": ("masenvs.mas.cli:main", "draw or export an auto-MAS design (designs.jsonl)"),
    "ui": ("masenvs.ui.server:main", "browse runs, trees, conversations and designs in a browser"),
    "openenv-serve": (
        "masenvs.integrations.openenv_serve:main",
        "serve an env as an OpenEnv environment server (reset/step/state sessions)",
    ),
    "search-serve": (
        "masenvs.search.server:main",
        "serve BM25 over a corpus at FlashRAG's /retrieve",
    ),
}

END_OF_ACTION = "."


def cmd_list(args: argparse.Namespace, console: Console) -> int:
    table = Table(title="masenvs environments")
    for column in ("name", "roles", "single-agent role", "renders"):
        table.add_column(column)
    for name in list_envs():
        try:
            cls = env_class(name)
        except ImportError as exc:  # an env whose optional dependencies are missing
            table.add_row(name, f"[red]unavailable: {exc}[/red]", "", "")
            continue
        table.add_row(name, ", ".join(cls.roles), cls.solo_role, ", ".join(cls.render_modes()))
    console.print(table)
    console.print(
        f"Also {', '.join(list_bridges())}: another framework's environment (an OpenEnv "
        "server by URL, a verifiers taskset) as a masenvs env; see docs/integrations.md."
    )
    return 0


def read_action(agent: str, stream: TextIO, console: Console) -> str | None:
    """Lines typed for `agent` until a line holding only '.'; None at end of input."""
    console.print(f"[bold cyan]{agent}[/bold cyan] > (end with a line holding only '.')")
    lines: list[str] = []
    for line in stream:
        if line.rstrip("\n") == END_OF_ACTION:
            return "\n".join(lines)
        lines.append(line.rstrip("\n"))
    return "\n".join(lines) if lines else None


def cmd_play(args: argparse.Namespace, console: Console, stream: TextIO = sys.stdin) -> int:
    config = parse_overrides(args.set)
    if args.single_agent:
        config["single_agent"] = True
    try:
        env = make(args.env, **config)
    except (KeyError, ValueError, TypeError) as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    observations, infos = env.reset(seed=args.seed)
    console.print(Panel(Text(env.render_text()), title=f"{env.name}, seed {args.seed}"))
    while env.agents:
        # One agent at a time, in the env's turn order: its prompt shows this round so far.
        agent, round_ = env.acting, env.round
        for message in infos[agent]["messages"]:
            # Text(): prompts are shown verbatim, never read as rich markup.
            console.print(Panel(Text(message["content"]), title=f"{agent} · {message['role']}"))
        action = read_action(agent, stream, console)
        if action is None:
            console.print("[yellow]input ended; episode stopped[/yellow]")
            return 0
        observations, rewards, terms, truncs, infos = env.step({agent: action})
        table = Table(title=f"round {round_ + 1}, {agent}'s turn")
        for column in ("agent", "reward", "process", "agent part", "team"):
            table.add_column(column)
        for agent, reward in rewards.items():
            parts = infos[agent]["reward_parts"]
            table.add_row(
                agent,
                f"{reward:+.3f}",
                f"{parts['process']:+.3f}",
                f"{parts['agent']:+.3f}",
                f"{parts['team']:+.3f}",
            )
        console.print(table)
        console.print(Panel(Text(env.render_text()), title="state"))
    outcome = "success" if env.state.success else "no success"
    console.print(f"[bold]episode over after {env.round} round(s): {outcome}[/bold]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="masenvs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the registered environments")
    play = sub.add_parser("play", help="play an environment yourself, seeing each agent's prompt")
    play.add_argument("env", help="environment name (see `masenvs list`)")
    play.add_argument("--seed", type=int, default=0)
    play.add_argument("--single-agent", action="store_true", help="one role does the whole task")
    play.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="env config field"
    )
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        # Piped to a file, rich would wrap at 80 columns: one progress line per step
        # (what grep and tail -f need) takes a wide console.
        os.environ["COLUMNS"] = "400"
    if argv and argv[0] in COMMANDS:
        return _settled(_lazy(argv[0])(argv[1:]))
    args = build_parser().parse_args(argv)
    console = Console()
    if args.command == "list":
        return cmd_list(args, console)
    return cmd_play(args, console)


def _settled(code: int) -> int:
    """`code`, once the threads of workflow programs stopped at their deadline have ended.
    One still blocked (a program stuck in a blocking call) would abort the interpreter's exit
    (see `settle_abandoned`), so the process then exits here, with `code`, its output flushed.
    """
    programs = sys.modules.get("masenvs.adapters.frameworks.programs")  # loaded: it ran some
    if programs is None or programs.settle_abandoned():
        return code
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _lazy(command: str) -> Callable[[list[str]], int]:
    module, _, attr = COMMANDS[command][0].partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as exc:
        raise SystemExit(
            f"`masenvs {command}` needs extra packages ({exc.name} is missing): "
            "pip install 'masenvs[all]'"
        ) from exc


if __name__ == "__main__":
    raise SystemExit(main())
