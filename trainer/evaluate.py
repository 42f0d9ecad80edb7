"""`masenvs eval`: avg@n and pass@k of several policies on the same tasks, side by side.

    masenvs eval --env plan_path --episodes 32 -k 4 --baseline \\
        --checkpoint runs/x/checkpoints/step_00000024
    masenvs eval --env math --source hf:math500 --data-path data/math500 -k 8 \\
        --url http://127.0.0.1:8001/v1 --served-model Qwen/Qwen3-1.7B

Every task is played `n` times (`-n`, default k) by each policy. avg@n is the mean success
over all n·tasks episodes; pass@k is the unbiased estimator of Chen et al. (2021),
1 - C(n-c, k) / C(n, k) for a task with c successes in n, averaged over tasks. Policies:
the base model and checkpoints' LoRA adapters on the embedded engine (each behind its own
capture endpoint, traces kept), and any OpenAI-compatible server (vLLM, `masenvs serve`, a
hosted API), called directly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from masenvs.adapters.policy import ChatPolicy, Reply, Sampling
from masenvs.adapters.rollout import EpisodeResult, run_episode
from masenvs.registry import make
from masenvs.tasks.records import TaskSourceError
from masenvs.traces import TraceStore

if TYPE_CHECKING:  # openai takes ~1 s to import: loaded on first use (fast --help)
    from openai import AsyncOpenAI

DEFAULT_SEED_START = 1_000_000  # ValidationConfig's: held out from training seeds


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k draws (without replacement) from n samples with c
    correct is correct: 1 - C(n-c, k) / C(n, k), computed as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


# -- tasks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalTask:
    """One task: an env seed, plus the task record itself for dataset tasks."""

    id: str
    seed: int
    options: dict[str, Any] | None = None  # env.reset options: {"task": record}


def seed_tasks(env_name: str, seed_start: int, episodes: int) -> list[EvalTask]:
    """The env's own tasks for seeds [seed_start, seed_start + episodes)."""
    return [EvalTask(f"{env_name}:{s}", s) for s in range(seed_start, seed_start + episodes)]


def dataset_tasks(
    env_name: str, env_options: dict[str, Any], limit: int | None = None
) -> list[EvalTask]:
    """Every task of the env's task list (`source` option: jsonl:, hf:, builtin), in order."""
    from masenvs.tasks.loaders import TaskList

    source = getattr(make(env_name, **env_options), "source", None)
    if not isinstance(source, TaskList):
        raise ValueError(
            f"env {env_name!r} with these options has no fixed task list to evaluate on; "
            "give a dataset (--source jsonl:FILE or hf:NAME, for the math and code envs) or "
            "evaluate on seeds (drop --source)"
        )
    tasks = list(source)[:limit] if limit is not None else list(source)
    return [
        EvalTask(getattr(t, "id", f"{source.name}:{i}"), i, {"task": t})
        for i, t in enumerate(tasks)
    ]


# -- policies ------------------------------------------------------------------------------


@dataclass
class Target:
    """One policy under evaluation and how to reach it."""

    name: str
    policy: ChatPolicy
    store: TraceStore | None = None  # the capture endpoint's traces (embedded targets)


class DirectPolicy(ChatPolicy):
    """Any OpenAI-compatible server, called as it is: no rollout URLs, no vLLM-only fields
    except `chat_template_kwargs` when some are set (vLLM and SGLang read it)."""

    def __init__(
        self,
        base_url: str,
        *,
        template_kwargs: dict[str, dict[str, Any]] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(base_url, **options)
        self.base_url = base_url.rstrip("/")  # any server's own base URL, used as given
        self.template_kwargs = template_kwargs or {}

    def client(self, rollout_id: str) -> AsyncOpenAI:
        from openai import AsyncOpenAI

        return AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, http_client=self._http, max_retries=2
        )

    async def act(
        self,
        rollout_id: str,
        agent: str,
        messages: list[dict[str, Any]],
        n: int = 1,
        sampling: Sampling | None = None,
    ) -> list[Reply]:
        s = sampling or self.agent_sampling.get(agent, self.sampling)
        extra = {}
        if self.template_kwargs.get(agent):
            extra["chat_template_kwargs"] = self.template_kwargs[agent]
        async with self._limit:
            response = await self.client(rollout_id).chat.completions.create(
                model=self.models.get(agent, agent),
                messages=messages,  # type: ignore[arg-type]
                n=n,
                temperature=s.temperature,
                top_p=s.top_p,
                max_tokens=s.max_tokens,
                extra_body=extra or None,
            )
        tokens = response.usage.completion_tokens if response.usage else 0
        return [
            Reply(
                text=c.message.content or "",
                completion_tokens=tokens // max(len(response.choices), 1),
                finish_reason=c.finish_reason or "stop",
                call_id=response.id,
            )
            for c in sorted(response.choices, key=lambda c: c.index)
        ]


# -- running -------------------------------------------------------------------------------


@dataclass
class TargetResult:
    """One policy's scores on the task set."""

    name: str
    tasks: int
    n: int  # episodes per task
    k: int
    avg: float  # avg@n: mean success over every episode
    pass_at_k: float  # mean over tasks of the unbiased pass@k
    rewards: dict[str, float]  # mean episode reward per agent
    completion_tokens: int
    errors: int  # episodes cut short by a failed call (counted as failures)
    seconds: float
    per_task: list[dict[str, Any]] = field(default_factory=list)  # id, successes


async def evaluate(
    target: Target,
    env_name: str,
    env_options: dict[str, Any],
    tasks: list[EvalTask],
    *,
    n: int,
    k: int,
    concurrency: int = 8,
    progress: Progress | None = None,
) -> TargetResult:
    """Play every task n times with `target`'s policy and score the episodes."""
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be between 1 and n={n} (episodes per task)")
    limit = asyncio.Semaphore(concurrency)
    bar = progress.add_task(target.name, total=len(tasks) * n) if progress else None
    started = time.perf_counter()

    async def one(task: EvalTask, j: int) -> EpisodeResult:
        async with limit:
            env = make(env_name, **env_options)
            result = await run_episode(
                env,
                target.policy,
                task.seed,
                rollout_id=f"eval-{task.seed}-{j}",
                store=target.store,
                options=task.options,
            )
            if progress is not None and bar is not None:
                progress.advance(bar)
            return result

    episodes = await asyncio.gather(*(one(t, j) for t in tasks for j in range(n)))
    seconds = time.perf_counter() - started
    per_task = []
    for i, task in enumerate(tasks):
        mine = episodes[i * n : (i + 1) * n]
        per_task.append({"id": task.id, "successes": sum(e.success for e in mine)})
    rewards: dict[str, list[float]] = defaultdict(list)
    for e in episodes:
        for agent, reward in e.rewards.items():
            rewards[agent].append(reward)
    return TargetResult(
        name=target.name,
        tasks=len(tasks),
        n=n,
        k=k,
        avg=sum(e.success for e in episodes) / len(episodes),
        pass_at_k=sum(pass_at_k(n, t["successes"], k) for t in per_task) / len(tasks),
        rewards={a: sum(v) / len(v) for a, v in sorted(rewards.items())},
        completion_tokens=sum(e.completion_tokens for e in episodes),
        errors=sum(e.error is not None for e in episodes),
        seconds=seconds,
        per_task=per_task,
    )


def results_table(results: list[TargetResult], title: str) -> Table:
    table = Table(title=title)
    agents = sorted({a for r in results for a in r.rewards})
    n, k = (results[0].n, results[0].k) if results else (1, 1)
    for column in ("policy", f"avg@{n}", f"pass@{k}"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for agent in agents:
        table.add_column(f"reward {agent}", justify="right")
    for column in ("tokens", "errors", "time"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r.name,
            f"{r.avg:.1%}",
            f"{r.pass_at_k:.1%}",
            *(f"{r.rewards[a]:+.3f}" if a in r.rewards else "" for a in agents),
            str(r.completion_tokens),
            str(r.errors),
            f"{r.seconds:.0f}s",
        )
    return table


# -- command line --------------------------------------------------------------------------


def parse_swaps(items: list[str], agents: list[str]) -> dict[str, str]:
    """`--swap A=B` items as {agent: the agent whose policy it plays with}, both ways."""
    swap: dict[str, str] = {}
    for item in items:
        a, sep, b = item.partition("=")
        a, b = a.strip(), b.strip()
        if not sep or not a or not b or a == b:
            raise ValueError(f"--swap {item!r} must name two different agents: --swap plan=tool")
        for name in (a, b):
            if name not in agents:
                raise ValueError(
                    f"--swap {item!r}: {name!r} is not an agent of this env ({', '.join(agents)})"
                )
            if name in swap:
                raise ValueError(f"--swap {item!r}: {name!r} is already swapped")
        swap[a], swap[b] = b, a
    return swap


def swap_label(swap: dict[str, str]) -> str:
    """' swap plan=tool' for a target's name; '' without swaps."""
    pairs = sorted({tuple(sorted(p)) for p in swap.items()})
    return "".join(f" swap {a}={b}" for a, b in pairs)


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
        "--episodes",
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
    scoring.add_argument("--temperature", type=float, default=0.7)
    scoring.add_argument("--top-p", type=float, default=1.0)
    scoring.add_argument(
        "--max-tokens", type=int, help="per call (default: the checkpoint's, else 512)"
    )
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
    policies.add_argument(
        "--model", help="base model of the embedded engine (default: the checkpoint's)"
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
    policies.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY", "-"), help="for --url servers"
    )
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
    from masenvs.trainer.checkpoint import load_latest
    from masenvs.trainer.config import load_config

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
        return _main(args, console)
    except ValueError as exc:
        console.print(f"[red]{exc}[/red]")
        return 2


def _main(args: argparse.Namespace, console: Console) -> int:
    from masenvs.adapters.stack import StackError
    from masenvs.overrides import parse_overrides

    checkpoints = [_checkpoint(p) for p in args.checkpoint]
    first = checkpoints[0].config if checkpoints else None
    env_name = args.env or (first.env.name if first else None)
    if env_name is None:
        raise ValueError("name the environment with --env (or give a --checkpoint)")
    env_options: dict[str, Any] = {}
    if first and env_name == first.env.name:  # the env as the checkpoint was trained on
        env_options.update(first.env.options)
        if first.rollout.max_rounds is not None:
            env_options["max_rounds"] = first.rollout.max_rounds
    env_options.update(parse_overrides(args.set))
    if args.source:
        env_options["source"] = args.source
    if args.data_path:
        env_options["data_path"] = args.data_path
    try:
        agents = list(make(env_name, **env_options).possible_agents)
        tasks = dataset_tasks(env_name, env_options, args.episodes) if args.source else []
    except (KeyError, TypeError, ValueError, TaskSourceError) as exc:
        raise ValueError(f"{env_name} with options {env_options}: {exc}") from None
    if not args.source:
        seed_start = args.seed_start
        if seed_start is None:
            seed_start = first.validation.seed_start if first else DEFAULT_SEED_START
        tasks = seed_tasks(env_name, seed_start, args.episodes or 32)
    args.swap_map = parse_swaps(args.swap, agents)
    n = args.n or args.k
    if not 1 <= args.k <= n:
        raise ValueError(f"-k {args.k} must be between 1 and -n {n} (episodes per task)")

    # Every policy samples alike; template variables: the checkpoint's per agent, then ours.
    max_tokens = args.max_tokens or (first.rollout.max_tokens if first else 512)
    sampling = Sampling(args.temperature, args.top_p, 0, max_tokens)
    template = {
        a: {**(first.agent(a).chat_template_kwargs if first else {}), **args.chat_template_kwargs}
        for a in agents
    }
    embedded = args.baseline or checkpoints or not args.url
    model = args.model or (first.model.name if first else "smollm2-135m")
    for c in checkpoints:
        if args.model is None and c.config.model.name != model:
            raise ValueError(
                f"checkpoints of one invocation share the engine's base model: {c.path} "
                f"trained {c.config.model.name}, the first {model}; evaluate them separately"
            )
    out = args.out or Path("runs") / f"eval-{time.strftime('%Y%m%d-%H%M%S')}.json"
    try:
        with console.status(f"loading {model}") if embedded else contextlib.nullcontext():
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
            console=console,
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
