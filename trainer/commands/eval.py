"""`masenvs eval`, the command line of `masenvs.trainer.evaluate` (which says what avg@n and
pass@k are and which policies it plays): several policies on the same tasks, side by side.

    masenvs eval --env plan_path --tasks 32 -k 4 --baseline \\
        --checkpoint runs/x/checkpoints/step_00000024
    masenvs eval --env math --source hf:math500 --data-path data/math500 -k 8 \\
        --url http://127.0.0.1:8001/v1 --served-model Qwen/Qwen3-1.7B
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from masenvs.adapters.episodes import phase_status
from masenvs.adapters.policy import ChatPolicy, Sampling
from masenvs.adapters.stack import add_model_arguments
from masenvs.cache import DEFAULT_MODEL
from masenvs.listeners import add_key_arguments, key_from
from masenvs.registry import make
from masenvs.sampling_args import DEFAULT as SAMPLING
from masenvs.sampling_args import SamplingArgs
from masenvs.tasks.records import TaskSourceError
from masenvs.traces import TraceStore
from masenvs.trainer.evaluate import (
    DEFAULT_SEED_START,
    DirectPolicy,
    EvalTask,
    Target,
    TargetResult,
    dataset_tasks,
    evaluate,
    parse_swaps,
    results_table,
    seed_tasks,
    swap_label,
)


def build_parser() -> argparse.ArgumentParser:
    from masenvs.adapters.stack import add_engine_arguments

    parser = argparse.ArgumentParser(
        prog="masenvs eval",
        description="avg@n and pass@k of base models, checkpoints and OpenAI-compatible "
        "servers on the same tasks, side by side.",
    )
    tasks = parser.add_argument_group("tasks")
    tasks.add_argument("--env", help="environment (default: the first checkpoint's)")
    tasks.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="env option")
    tasks.add_argument(
        "--tasks",
        type=int,
        help="tasks to evaluate (default: 32 seeds; with --source: every task of the dataset)",
    )
    tasks.add_argument(
        "--seed-start",
        type=int,
        help=f"first task seed (default: the checkpoint's validation seeds, else "
        f"{DEFAULT_SEED_START})",
    )
    tasks.add_argument("--source", help="dataset tasks: jsonl:FILE, hf:NAME, builtin (math, code)")
    tasks.add_argument("--data-path", help="local copy of an hf: dataset")
    scoring = parser.add_argument_group("scoring and sampling")
    scoring.add_argument("-k", type=int, default=1, help="k of pass@k (default 1)")
    scoring.add_argument("-n", type=int, help="episodes per task (default k)")
    SamplingArgs.add_cli_args(
        scoring,
        defaults={
            "temperature": (0.7, "answers sampled for pass@k, a little cooler than "
                            "training's 1.0"),
            "max_tokens": (None, "the checkpoint's rollout.max_tokens, else "
                           f"{SAMPLING.max_tokens}"),
        },
    )  # fmt: skip
    scoring.add_argument(
        "--chat-template-kwargs",
        type=json.loads,
        default={},
        metavar="JSON",
        help="chat template variables for every agent, e.g. '{\"enable_thinking\": false}' "
        "(a checkpoint's agents.<name>.chat_template_kwargs apply too)",
    )
    policies = parser.add_argument_group("policies (side by side)")
    policies.add_argument(
        "--baseline", action="store_true", help="the base model (default when nothing else)"
    )
    policies.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="DIR",
        help="a checkpoint (runs/x/checkpoints/step_N) or a run dir (its latest); repeatable",
    )
    add_model_arguments(
        policies, None, "base model of the embedded engine (default: the checkpoint's)", False
    )
    policies.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="BASE_URL",
        help="an OpenAI-compatible server, e.g. http://127.0.0.1:8001/v1 (vLLM); repeatable",
    )
    policies.add_argument(
        "--served-model",
        action="append",
        default=[],
        metavar="NAME|AGENT=NAME",
        help="model name the --url servers get (default: the agent's name)",
    )
    add_key_arguments(policies, "OPENAI_API_KEY", "the API key of the --url servers", required="")
    policies.add_argument(
        "--swap",
        action="append",
        default=[],
        metavar="A=B",
        help="role swap: agent A plays with agent B's trained policy and B with A's "
        "(Stronger-MAS's swapped-policies test, e.g. --swap plan=tool); repeatable",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="episodes in flight")
    parser.add_argument("--device", default="auto", help="embedded engine: auto, cpu or cuda")
    add_engine_arguments(parser)
    parser.add_argument("--out", type=Path, help="JSON results (default runs/eval-TIME.json)")
    return parser


@dataclass
class _Checkpoint:
    label: str
    path: Path
    config: Any  # TrainConfig


def _checkpoint(path: str) -> _Checkpoint:
    from masenvs.trainer.config import load_config
    from masenvs.trainer.run.checkpoint import load_latest

    where = Path(path)
    if not (where / "adapters").is_dir():
        latest = load_latest(where) if where.is_dir() else None
        if latest is None:
            raise ValueError(
                f"{path} is neither a checkpoint (a step_* directory with adapters/) nor a run "
                "directory with checkpoints; pass runs/NAME/checkpoints/step_N or runs/NAME"
            )
        where = latest.path
    step = where.name.removeprefix("step_").lstrip("0") or "0"
    return _Checkpoint(
        f"{where.parent.parent.name}@{step}", where, load_config(where / "config.yaml")
    )


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    try:
        args.api_key = key_from(args, "OPENAI_API_KEY") or "-"
        return _main(args, console)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2


def _main(args: argparse.Namespace, console: Console) -> int:
    from masenvs.adapters.stack import StackError

    checkpoints = [_checkpoint(p) for p in args.checkpoint]
    first = checkpoints[0].config if checkpoints else None
    env_name = args.env or (first.env.name if first else None)
    if env_name is None:
        raise ValueError("name the environment with --env (or give a --checkpoint)")
    env_options = _env_options(args, env_name, first)
    agents, tasks = _agents_and_tasks(args, env_name, env_options, first)
    args.swap_map = parse_swaps(args.swap, agents)
    n = args.n or args.k
    if not 1 <= args.k <= n:
        raise ValueError(f"-k {args.k} must be between 1 and -n {n} (episodes per task)")

    # Every policy samples alike; template variables: the checkpoint's per agent, then ours.
    max_tokens = first.rollout.max_tokens if first else SAMPLING.max_tokens
    sampling = Sampling.from_cli_args(args, max_tokens=max_tokens)
    template = {
        a: {**(first.agent(a).chat_template_kwargs if first else {}), **args.chat_template_kwargs}
        for a in agents
    }
    embedded = args.baseline or checkpoints or not args.url
    model = args.model or (first.model.name if first else DEFAULT_MODEL)
    for c in checkpoints:
        if args.model is None and c.config.model.name != model:
            raise ValueError(
                f"checkpoints of one invocation share the engine's base model: {c.path} "
                f"trained {c.config.model.name}, the first {model}; evaluate them separately"
            )
    out = args.out or Path("runs") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}.json"
    try:
        loading = phase_status(console, f"loading {model}") if embedded else None
        with loading or contextlib.nullcontext():
            setup = _Setup.start(args, model, checkpoints, agents, template, sampling, out)
    except StackError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    setup.add_urls(args, template, sampling)
    console.print(
        f"{len(tasks)} tasks of {env_name}, {n} episode(s) each, T={args.temperature}: "
        + ", ".join(t.name for t in setup.targets)
    )
    try:
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            disable=not console.is_terminal,  # a log gets evaluate's lines instead
        ) as progress:
            results = asyncio.run(
                setup.run(env_name, env_options, tasks, n, args.k, args.concurrency, progress)
            )
    finally:
        setup.close()
    title = f"{env_name}: {len(tasks)} tasks, n={n}"
    console.print(results_table(results, title))
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "env": env_name,
        "env_options": {k: v for k, v in env_options.items() if k != "task"},
        "tasks": [t.id for t in tasks],
        "n": n,
        "k": args.k,
        "sampling": asdict(sampling),
        "chat_template_kwargs": template,
        "swap": args.swap_map,
        "results": [asdict(r) for r in results],
    }
    out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    console.print(f"results: {out}")
    return 0


def _env_options(args: argparse.Namespace, env_name: str, first: Any) -> dict[str, Any]:
    """The env's options: the first checkpoint's validation env (when it is the same env),
    then `--set`, `--source` and `--data-path`."""
    from masenvs.overrides import parse_overrides

    env_options: dict[str, Any] = {}
    if first and env_name == first.env.name:  # the env as the checkpoint was validated on
        env_options.update(first.env.options)
        if first.rollout.max_rounds is not None:
            env_options["max_rounds"] = first.rollout.max_rounds
        env_options.update(first.validation.env_options)  # e.g. a curriculum's whole task
    env_options.update(parse_overrides(args.set))
    if args.source:
        env_options["source"] = args.source
    if args.data_path:
        env_options["data_path"] = args.data_path
    return env_options


def _agents_and_tasks(
    args: argparse.Namespace, env_name: str, env_options: dict[str, Any], first: Any
) -> tuple[list[str], list[Any]]:
    """The env's agents, and the tasks: a dataset's (`--source`) or seeds from `--seed-start`
    (else the checkpoint's validation seeds)."""
    try:
        agents = list(make(env_name, **env_options).possible_agents)
        tasks = dataset_tasks(env_name, env_options, args.tasks) if args.source else []
    except (KeyError, TypeError, ValueError, TaskSourceError) as exc:
        raise ValueError(f"{env_name} with options {env_options}: {exc}") from None
    if not args.source:
        seed_start = args.seed_start
        if seed_start is None:
            seed_start = first.validation.seed_start if first else DEFAULT_SEED_START
        tasks = seed_tasks(env_name, seed_start, args.tasks or 32)
    return agents, tasks


@dataclass
class _Setup:
    """The embedded engine with every checkpoint's adapters, one endpoint per policy."""

    targets: list[Target]
    servers: list[Any]
    backend: Any = None

    @classmethod
    def start(
        cls,
        args: argparse.Namespace,
        model: str,
        checkpoints: list[_Checkpoint],
        agents: list[str],
        template: dict[str, dict[str, Any]],
        sampling: Sampling,
        out: Path,
    ) -> _Setup:
        setup = cls([], [])
        if not (args.baseline or checkpoints or not args.url):
            return setup
        from masenvs.adapters.endpoint import EndpointServer, create_app
        from masenvs.adapters.policy_map import BASE, PolicyMap
        from masenvs.adapters.stack import StackError, engine_options, make_backend

        options = engine_options(args)
        if args.batch_invariant is None and checkpoints:  # validate as the run did
            options["batch_invariant"] = checkpoints[0].config.backend.batch_invariant
        if args.device != "auto":
            options["device"] = args.device
        setup.backend = backend = make_backend(model, "embedded", **options)
        routes: list[tuple[str, dict[str, str]]] = []
        if args.baseline or not checkpoints:
            routes.append(("base", {a: BASE for a in agents}))
        swap = getattr(args, "swap_map", {})
        for i, c in enumerate(checkpoints):
            route = {}
            for agent in agents:
                policy = c.config.policy.policy_of(swap.get(agent, agent))
                name = f"ckpt{i}.{policy}"
                if name not in backend.model_names():
                    path = c.path / "adapters" / policy
                    try:
                        asyncio.run(backend.load_adapter(name, str(path)))
                    except (OSError, ValueError, KeyError) as exc:
                        raise StackError(f"could not load {path}: {exc}") from exc
                route[agent] = name
            routes.append((c.label + swap_label(swap), route))
        traces = out.with_suffix("")  # runs/eval-TIME/<policy>/ next to the JSON
        for label, route in routes:
            store = TraceStore(traces / label.replace("/", "_").replace("@", "_"))
            policy_map = PolicyMap(route, chat_template_kwargs=template)
            server = EndpointServer(create_app(backend, store=store, policy_map=policy_map))
            server.start()
            setup.servers.append(server)
            policy = ChatPolicy(server.url, sampling=sampling)
            setup.targets.append(Target(label, policy, store))
        return setup

    def add_urls(
        self,
        args: argparse.Namespace,
        template: dict[str, dict[str, Any]],
        sampling: Sampling,
    ) -> None:
        names: dict[str, str] = {}
        every: str | None = None
        for item in args.served_model:
            agent, sep, name = item.partition("=")
            if sep:
                names[agent] = name
            else:
                every = item
        swap = getattr(args, "swap_map", {})
        for url in args.url:
            # A swapped agent asks for the model its partner's name would get.
            models = {a: names.get(swap.get(a, a), every or swap.get(a, a)) for a in template}
            policy = DirectPolicy(
                url,
                api_key=args.api_key,
                sampling=sampling,
                models=models,
                template_kwargs=template,
            )
            self.targets.append(Target(url + swap_label(swap), policy))

    async def run(
        self,
        env_name: str,
        env_options: dict[str, Any],
        tasks: list[EvalTask],
        n: int,
        k: int,
        concurrency: int,
        progress: Progress,
    ) -> list[TargetResult]:
        results = []
        try:
            for target in self.targets:  # one after another: each gets the whole machine
                results.append(
                    await evaluate(
                        target,
                        env_name,
                        env_options,
                        tasks,
                        n=n,
                        k=k,
                        concurrency=concurrency,
                        progress=progress,
                    )
                )
        finally:
            for target in self.targets:
                await target.policy.aclose()
        return results

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        for target in self.targets:
            if target.store is not None:
                target.store.close()
        if self.backend is not None:
            self.backend.shutdown()
