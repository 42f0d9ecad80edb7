"""`masenvs rollout`: run episodes of an env with an LLM policy (the episodes themselves are
`masenvs.adapters.episodes`).

    masenvs rollout --env math --model tiny --episodes 8
    masenvs rollout --env math --url http://127.0.0.1:8000/v1 --workflow my_graph:build \
        --framework langgraph --agents solver,checker --branches 2

`--url` uses a running `masenvs serve` (its printed `/v1` URL or its root; it records the
traces) instead of loading a model; `--workflow` runs your own program's factory instead of
one `ChatPolicy` call per turn (workflow mode: the env's task, K runs, the env's score).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

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
from rich.table import Table
from rich.text import Text

from masenvs.adapters import episodes
from masenvs.adapters.policy import ChatPolicy, Sampling, server_root
from masenvs.adapters.stack import add_engine_arguments, add_model_arguments, with_endpoint
from masenvs.listeners import API_KEY_ENV, ListenerError, add_key_arguments, key_from
from masenvs.registry import env_class, make
from masenvs.sampling_args import SamplingArgs


def summary_table(results: list[episodes.EpisodeResult], seconds: float) -> Table:
    table = Table(title=f"{len(results)} episodes of {results[0].env}" if results else "episodes")
    agents = sorted({a for r in results for a in r.rewards})
    table.add_column("success")
    for agent in agents:
        table.add_column(f"reward {agent}")
    for column in ("rounds", "tokens", "tokens/s", "errors"):
        table.add_column(column)
    n = max(len(results), 1)
    tokens = sum(r.completion_tokens for r in results)
    table.add_row(
        f"{sum(r.success for r in results) / n:.0%}",
        *(f"{sum(r.rewards.get(a, 0.0) for r in results) / n:+.3f}" for a in agents),
        f"{sum(r.rounds for r in results) / n:.2f}",
        str(tokens),
        f"{tokens / max(seconds, 1e-9):.1f}",
        str(sum(r.error is not None for r in results)),
    )
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="masenvs rollout", description="Run episodes of an env with an LLM policy."
    )
    parser.add_argument("--env", required=True, help="environment name (see `masenvs list`)")
    parser.add_argument(
        "--episodes", type=int, default=8, help="episodes, one task each (seeds from --seed)"
    )
    parser.add_argument("--seed", type=int, default=0, help="first task seed")
    add_model_arguments(parser)
    parser.add_argument("--backend", choices=["embedded", "vllm"], default="embedded")
    parser.add_argument("--vllm-url", help="URL of a running `vllm serve` (with --backend vllm)")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes in flight")
    add_engine_arguments(parser)
    SamplingArgs.add_cli_args(
        parser.add_argument_group("sampling"),
        defaults={
            "temperature": (0.7, "as masenvs eval, a little cooler than training's 1.0"),
            "max_tokens": (None, "the env's answer length, e.g. 64 for the grid tasks, 256 "
                           "for math and code"),
        },
    )  # fmt: skip
    parser.add_argument("--single-agent", action="store_true")
    parser.add_argument(
        "--turn-order",
        choices=["sequential", "simultaneous"],
        help="sequential (default): a later agent sees this round's earlier actions",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--traces", type=Path, help="trace directory (default runs/rollout-*)")
    parser.add_argument(
        "--url",
        metavar="BASE_URL",
        help="a running `masenvs serve` (its /v1 URL as printed, or its root): no model is "
        "loaded here, and the server records the traces",
    )
    add_key_arguments(parser, API_KEY_ENV, "the API key of the --url server", required="")
    workflow = parser.add_argument_group("workflow mode (your own LangGraph/AutoGen/LlamaIndex)")
    workflow.add_argument(
        "--workflow", metavar="MODULE:FUNCTION", help="factory: WorkflowContext -> program"
    )
    workflow.add_argument("--framework", choices=["langgraph", "autogen", "llamaindex"])
    workflow.add_argument("--agents", help="comma-separated model names the program's clients use")
    workflow.add_argument("--answer-from", help="LangGraph state key / AutoGen agent")
    workflow.add_argument(
        "--branches", type=int, default=1, help="K: runs of each task (one advantage group)"
    )
    workflow.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    return parser


def rollout_policy_map(args: argparse.Namespace, spec: Any, env_config: dict[str, Any]) -> Any:
    """The run's agents (the env's roles, or the workflow's agents) each to its `--route`
    adapter, an adapter of its name, or the base model; any other model name is a 404 naming
    the known ones, unless `--unknown-agents base` (as `masenvs serve` and `train` do)."""
    from masenvs.adapters.policy_map import BASE, PolicyMap
    from masenvs.adapters.stack import parse_pairs

    routes = parse_pairs(args.route, "--route")
    adapters = parse_pairs(args.adapter, "--adapter")
    if spec is not None:
        agents = [*spec.agents, *spec.agent_map]
    else:
        env = make(args.env, **env_config)
        agents = [*env.possible_agents, *env.callers]
    for agent in agents:
        if agent not in routes and agent not in adapters:
            routes[agent] = BASE
    return PolicyMap(
        routes,
        default=BASE if args.unknown_agents == "base" else None,
        reject_hint="; pass --unknown-agents base to serve any name with the base model",
    )


def main(argv: list[str]) -> int:
    from masenvs.adapters.stack import StackError, engine_options, parse_pairs, start_stack
    from masenvs.overrides import parse_overrides

    args = build_parser().parse_args(argv)
    console = Console()
    try:
        args.api_key = key_from(args, API_KEY_ENV)
    except ListenerError as exc:
        console.print(f"[red]masenvs rollout: {escape(str(exc))}[/red]")
        return 2
    spec = None
    if args.workflow:
        try:
            spec = _workflow_spec(args)
        except ValueError as exc:
            console.print(f"[red]masenvs rollout: {exc}[/red]")
            return 2
    env_config = parse_overrides(args.set)
    if args.single_agent:
        env_config["single_agent"] = True
    if args.turn_order:
        env_config["turn_order"] = args.turn_order
    try:
        make(args.env, **env_config)  # fail on a bad env or config before loading a model
    except (KeyError, ValueError, TypeError) as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    if args.max_tokens is None:
        args.max_tokens = env_class(args.env).answer_tokens
    if args.url:
        return _remote(args, spec, env_config, console)
    traces = args.traces or Path("runs") / f"rollout-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        with episodes.phase_status(console, f"loading {args.model} ({args.backend})"):
            stack = start_stack(
                model=args.model,
                backend=args.backend,
                vllm_url=args.vllm_url,
                traces=traces,
                adapters=parse_pairs(args.adapter, "--adapter"),
                policy_map=rollout_policy_map(args, spec, env_config),
                **(engine_options(args) if args.backend == "embedded" else {}),
            )
    except StackError as exc:
        console.print(f"[red]{escape(str(exc))}[/red]")
        return 2
    env_config = with_endpoint(args.env, env_config, stack.root_url, stack.api_key)
    sampling = Sampling.from_cli_args(args)
    seeds = list(range(args.seed, args.seed + args.episodes))
    started = time.perf_counter()
    if spec is not None:
        try:
            return _workflows(args, spec, env_config, console, stack.root_url, stack)
        finally:
            stack.close()
            console.print(f"traces: {traces}")
    try:
        with _episode_progress(console, args, len(seeds)) as progress:
            results = asyncio.run(
                _run(stack.root_url, sampling, args, seeds, env_config, stack, progress)
            )
    finally:
        stack.close()
    console.print(summary_table(results, time.perf_counter() - started))
    for r in results:
        if r.error:
            console.print(f"[yellow]{r.rollout_id} (seed {r.seed}) stopped: {r.error}[/yellow]")
    console.print(f"traces: {traces}")
    return 0


def _episode_progress(console: Console, args: argparse.Namespace, episodes: int) -> Progress:
    """The episodes' bar with an ETA on a terminal; in a log, a first line now, then
    run_episodes' lines (one per episode, one every 30 s), each with its ETA."""
    if not console.is_terminal:
        console.print(f"{episodes} episodes of {args.env}, {args.concurrency} at a time")
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,  # a log gets run_episodes' lines, not a bar's dump
    )


async def _run(base_url, sampling, args, seeds, env_config, stack, progress):
    policy = ChatPolicy(base_url, sampling=sampling, api_key=stack.api_key or "masenvs")
    try:
        return await episodes.run_episodes(
            args.env,
            policy,
            seeds,
            env_config=env_config,
            store=stack.store,
            concurrency=args.concurrency,
            progress=progress,
        )
    finally:
        await policy.aclose()


# -- `--url` and `--workflow` ------------------------------------------------------------------


def _workflow_spec(args: argparse.Namespace) -> Any:
    from masenvs.adapters.frameworks.workflow import WorkflowSpec

    if not args.framework or not args.agents:
        raise ValueError("--workflow needs --framework and --agents (the model names it uses)")
    spec = WorkflowSpec(
        factory=args.workflow,
        framework=args.framework,
        agents=[a.strip() for a in args.agents.split(",") if a.strip()],
        answer_from=args.answer_from,
        timeout_s=args.timeout_s,
        unknown_agents=args.unknown_agents,
    )
    spec.builder()  # a bad factory, or a builder parameter no agent maps to, fails here
    return spec


def _remote(
    args: argparse.Namespace, spec: Any, env_config: dict[str, Any], console: Console
) -> int:
    """Episodes or workflow runs against a running `masenvs serve`, which records them."""
    env_config = with_endpoint(args.env, env_config, server_root(args.url), args.api_key)
    if spec is not None:
        return _workflows(args, spec, env_config, console, args.url, None)
    sampling = Sampling.from_cli_args(args)
    seeds = list(range(args.seed, args.seed + args.episodes))
    started = time.perf_counter()

    async def run(progress: Progress) -> list[episodes.EpisodeResult]:
        policy = ChatPolicy(args.url, sampling=sampling, api_key=args.api_key or "masenvs")
        try:
            return await episodes.run_episodes(
                args.env, policy, seeds, env_config=env_config, progress=progress
            )
        finally:
            await policy.aclose()

    try:
        with _episode_progress(console, args, len(seeds)) as progress:
            results = asyncio.run(run(progress))
    except ValueError as exc:
        console.print(f"[red]masenvs rollout: {exc}[/red]")
        return 2
    console.print(summary_table(results, time.perf_counter() - started))
    for r in results:
        if r.error:
            console.print(f"[yellow]{r.rollout_id} (seed {r.seed}) stopped: {r.error}[/yellow]")
    return 0


def _workflows(
    args: argparse.Namespace,
    spec: Any,
    env_config: dict[str, Any],
    console: Console,
    url: str,
    stack: Any,
) -> int:
    """K runs of the user's program per task; a table of the runs, 1 if every run failed."""
    from masenvs.adapters.frameworks.clients import ClientSettings
    from masenvs.adapters.frameworks.workflow import run_tasks

    settings = ClientSettings(
        sampling=Sampling.from_cli_args(args),
        api_key=args.api_key or "masenvs",
    )
    seeds = list(range(args.seed, args.seed + args.episodes))
    started = time.perf_counter()
    try:
        runs = asyncio.run(
            run_tasks(
                spec,
                root_url=url,
                env_name=args.env,
                seeds=seeds,
                branches=args.branches,
                env_options=env_config,
                settings=settings,
                store=stack.store if stack is not None else None,
                endpoint=stack.endpoint if stack is not None else None,
                prefix=episodes.new_rollout_id("wf"),
                concurrency=args.concurrency,
            )
        )
    except (ValueError, OSError) as exc:  # a bad URL or an unreachable server, up front
        console.print(f"[red]masenvs rollout: {exc}[/red]")
        return 2
    table = Table(
        title=f"{len(runs)} runs of {spec.factory} in {time.perf_counter() - started:.1f}s"
    )
    for column in ("rollout", "task", "reward", "success", "seconds", "answer / error"):
        table.add_column(column, overflow="fold")
    for r in runs:
        # Text(): answers and errors are shown verbatim, never read as rich markup.
        shown = Text(r.error, style="red") if r.error else Text(r.answer.replace("\n", " ")[:60])
        table.add_row(
            r.rollout_id,
            r.task_id,
            f"{r.reward:+.3f}",
            "yes" if r.success else "no",
            f"{r.seconds:.1f}",
            shown,
        )
    console.print(table)
    failed = sum(r.error is not None for r in runs)
    console.print(
        f"success {sum(r.success for r in runs) / len(runs):.0%}, mean reward "
        f"{sum(r.reward for r in runs) / len(runs):+.3f}, failed runs {failed}/{len(runs)}"
    )
    timed_out = [r for r in runs if (r.error or "").startswith("ProgramTimeout")]
    if timed_out:  # the fix, once, not in each run's row
        console.print(
            f"[yellow]{len(timed_out)} run(s) ran past --timeout-s={args.timeout_s:g}: raise "
            "--timeout-s or lower --max-tokens[/yellow]"
        )
    return 1 if failed == len(runs) else 0
