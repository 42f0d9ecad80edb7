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
from masenvs.trainer.eval_checkpoints import Engines, EvalCheckpoint, open_checkpoint
from masenvs.trainer.evaluate import (
    DEFAULT_SEED_START,
    SWAP_TASKS,
    DirectPolicy,
    EvalTask,
    Target,
    TargetResult,
    check_swap,
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
        help=f"tasks to evaluate (default: 32 seeds, or with --source every task of the "
        f"dataset; with --swap the first {SWAP_TASKS}, the paper's swap protocol)",
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
            "temperature": (None, "0.7, answers sampled for pass@k, a little cooler "
                            "than training's 1.0; with --swap 0, greedy, as the paper's "
                            "swap test"),
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
        "(Stronger-MAS's swapped-policies test, e.g. --swap plan=tool); repeatable. As the "
        f"paper ran it: {SWAP_TASKS} held-out tasks, greedy (temperature 0), unless --tasks "
        "or --temperature say otherwise; A and B must have different trained weights",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="episodes in flight")
    parser.add_argument(
        "--device",
        default="auto",
        help="embedded engine: auto (a GPU if there is one), cpu or cuda",
    )
    add_engine_arguments(parser)
    parser.add_argument("--out", type=Path, help="JSON results (default runs/eval-TIME.json)")
    return parser


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

    checkpoints = [open_checkpoint(p) for p in args.checkpoint]
    first = checkpoints[0].config if checkpoints else None
    env_name = args.env or (first.env.name if first else None)
    if env_name is None:
        raise ValueError("name the environment with --env (or give a --checkpoint)")
    env_options = _env_options(args, env_name, first)
    agents, tasks = _agents_and_tasks(args, env_name, env_options, first)
    args.swap_map = _swaps(args, agents, checkpoints)
    n = args.n or args.k
    if not 1 <= args.k <= n:
        raise ValueError(f"-k {args.k} must be between 1 and -n {n} (episodes per task)")

    # Every policy samples alike; template variables: the checkpoint's per agent, then ours.
    max_tokens = first.rollout.max_tokens if first else SAMPLING.max_tokens
    # The swap test as the paper ran it is greedy; a plain evaluation samples for pass@k.
    temperature = 0.0 if args.swap_map else 0.7
    sampling = Sampling.from_cli_args(args, max_tokens=max_tokens, temperature=temperature)
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
        base = args.baseline or any(c.config.policy.finetune == "lora" for c in checkpoints)
        what = model if base or not checkpoints else "the models of " + checkpoints[0].label
        loading = phase_status(console, f"loading {what}") if embedded else None
        with loading or contextlib.nullcontext():
            setup = _Setup.start(args, model, checkpoints, agents, template, sampling, out)
    except StackError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    setup.add_urls(args, template, sampling)
    _print_header(console, args, (len(tasks), env_name), n, sampling, setup)
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


def _swaps(
    args: argparse.Namespace, agents: list[str], checkpoints: list[EvalCheckpoint]
) -> dict[str, str]:
    """`--swap`'s pairs, each of which must exchange different weights in every checkpoint
    and on every --url server (a swap of identical weights would score the unswapped run)."""
    swap = parse_swaps(args.swap, agents)
    for c in checkpoints:
        c.check_swap(swap)
    fix = "Name each role's model: " + " ".join(f"--served-model {a}=NAME" for a in swap)
    for url in args.url:
        named = {a: f"the model {m!r} of {url}" for a, m in _url_models(args, agents).items()}
        check_swap(swap, named, url, fix)
    return swap


def _print_header(
    console: Console,
    args: argparse.Namespace,
    tasks: tuple[int, str],
    n: int,
    sampling: Sampling,
    setup: Any,
) -> None:
    """What is about to run: `100 tasks of plan_path, 1 episode(s) each, T=0 (greedy): ...`,
    and for a swap whether it is the paper's protocol."""
    count, env_name = tasks
    t = sampling.temperature
    console.print(
        f"{count} tasks of {env_name}, {n} episode(s) each, T={t:g}{' (greedy)' * (t == 0)}: "
        + ", ".join(target.name for target in setup.targets)
    )
    if args.swap_map:
        protocol = count == SWAP_TASKS and t == 0
        console.print(
            f"role{swap_label(args.swap_map)}: Stronger-MAS's protocol is {SWAP_TASKS} "
            "held-out tasks, greedy; "
            + ("this is it" if protocol else f"this run differs ({count} tasks, T={t:g})")
        )


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
        count = args.tasks or (SWAP_TASKS if args.swap else None)
        tasks = dataset_tasks(env_name, env_options, count) if args.source else []
    except (KeyError, TypeError, ValueError, TaskSourceError) as exc:
        raise ValueError(f"{env_name} with options {env_options}: {exc}") from None
    if not args.source:
        seed_start = args.seed_start
        if seed_start is None:
            seed_start = first.validation.seed_start if first else DEFAULT_SEED_START
        tasks = seed_tasks(env_name, seed_start, count or 32)
    return agents, tasks


def engine_device(device: str) -> str:
    """`--device`: 'auto' is the GPU where torch sees one, else the CPU."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _url_models(
    args: argparse.Namespace, agents: list[str], swap: dict[str, str] | None = None
) -> dict[str, str]:
    """The model name each agent asks a --url server for (`--served-model`), played with
    `swap[agent]`'s name where swapped."""
    names: dict[str, str] = {}
    every: str | None = None
    for item in args.served_model:
        agent, sep, name = item.partition("=")
        if sep:
            names[agent] = name
        else:
            every = item
    swap = swap or {}
    return {a: names.get(swap.get(a, a), every or swap.get(a, a)) for a in agents}


@dataclass
class _Setup:
    """The embedded engines with every checkpoint's weights, one endpoint per policy."""

    targets: list[Target]
    servers: list[Any]
    engines: Engines | None = None

    @classmethod
    def start(
        cls,
        args: argparse.Namespace,
        model: str,
        checkpoints: list[EvalCheckpoint],
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
        from masenvs.adapters.stack import engine_options

        options = engine_options(args)
        if args.batch_invariant is None and checkpoints:  # validate as the run did
            options["batch_invariant"] = checkpoints[0].config.backend.batch_invariant
        options["device"] = engine_device(args.device)
        setup.engines = engines = Engines(model, options)
        routes: list[tuple[str, dict[str, str]]] = []
        try:
            if args.baseline or not checkpoints:
                routes.append(("base", {a: engines.serve(BASE, "base", model) for a in agents}))
            swap = getattr(args, "swap_map", {})
            for i, c in enumerate(checkpoints):
                route = {}
                for agent in agents:  # a swapped seat plays with its partner's weights
                    partner = swap.get(agent, agent)
                    name = f"ckpt{i}.{c.config.policy.policy_of(partner)}"
                    route[agent] = engines.serve(name, *c.weights_of(partner))
                routes.append((c.label + swap_label(swap), route))
            backend = engines.front()
        except BaseException:
            engines.shutdown()
            raise
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
        swap = getattr(args, "swap_map", {})
        for url in args.url:
            # A swapped agent asks for the model its partner's name would get.
            models = _url_models(args, list(template), swap)
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
        if self.engines is not None:
            self.engines.shutdown()
