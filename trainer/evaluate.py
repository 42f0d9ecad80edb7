"""avg@n and pass@k of several policies on the same tasks, side by side (the library;
the `masenvs eval` command line is `masenvs.trainer.commands.eval`).

Every task is played `n` times (`-n`, default k) by each policy. avg@n is the mean success
over all n·tasks episodes; pass@k is the unbiased estimator of Chen et al. (2021),
1 - C(n-c, k) / C(n, k) for a task with c successes in n, averaged over tasks. Policies:
the base model and checkpoints' LoRA adapters on the embedded engine (each behind its own
capture endpoint, traces kept), and any OpenAI-compatible server (vLLM, `masenvs serve`, a
hosted API), called directly.
"""

from __future__ import annotations

import asyncio
import difflib
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.progress import Progress
from rich.table import Table

from masenvs.adapters.episodes import EpisodeResult, run_episode
from masenvs.adapters.policy import ChatPolicy, Reply, Sampling
from masenvs.registry import make
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
        extra: dict[str, Any] = {}
        if self.template_kwargs.get(agent):
            extra["chat_template_kwargs"] = self.template_kwargs[agent]
        if s.top_k:  # vLLM's extras, sent only when set (--top-k, --repetition-penalty)
            extra["top_k"] = s.top_k
        if s.repetition_penalty != 1.0:
            extra["repetition_penalty"] = s.repetition_penalty
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
    # The env's rates beside success (plan-path: optimal, exact_stop), over every episode.
    metrics: dict[str, float] = field(default_factory=dict)


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
    log_lines = progress is not None and not progress.console.is_terminal
    if log_lines:
        progress.console.print(f"{target.name}: {len(tasks)} tasks x {n} episodes")
    printed = [started]

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
                if log_lines:
                    _log_line(progress, bar, target.name, started, printed)
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
    names = sorted({name for e in episodes for name in e.metrics})
    metrics = {n: sum(e.metrics.get(n, 0.0) for e in episodes) / len(episodes) for n in names}
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
        metrics=metrics,
    )


def results_table(results: list[TargetResult], title: str) -> Table:
    table = Table(title=title)
    agents = sorted({a for r in results for a in r.rewards})
    rates = sorted({name for r in results for name in r.metrics})
    n, k = (results[0].n, results[0].k) if results else (1, 1)
    for column in ("policy", f"avg@{n}", f"pass@{k}", *(m.replace("_", " ") for m in rates)):
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
            *(f"{r.metrics[m]:.1%}" if m in r.metrics else "" for m in rates),
            *(f"{r.rewards[a]:+.3f}" if a in r.rewards else "" for a in agents),
            str(r.completion_tokens),
            str(r.errors),
            f"{r.seconds:.0f}s",
        )
    return table


# -- role swaps ----------------------------------------------------------------------------


SWAP_TASKS = 100  # Stronger-MAS's swap test: 100 fixed held-out tasks, played greedily


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
                close = difflib.get_close_matches(name, agents, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"--swap {item!r}: {name!r} is not an agent of this env "
                    f"({', '.join(agents)}){hint}"
                )
            if name in swap:
                raise ValueError(f"--swap {item!r}: {name!r} is already swapped")
        swap[a], swap[b] = b, a
    return swap


def check_swap(swap: dict[str, str], weights: dict[str, str], target: str, fix: str) -> None:
    """Refuse a swap that exchanges identical weights: `weights[agent]` says what answers
    the agent's calls unswapped; a pair with the same would score the unswapped policy."""
    for a, b in sorted({tuple(sorted(p)) for p in swap.items()}):
        if weights[a] == weights[b]:
            raise ValueError(
                f"--swap {a}={b} changes nothing for {target}: {a} and {b} play with the same "
                f"weights ({weights[a]}), and swapping identical weights leaves every answer "
                f"as it was. {fix}"
            )


def swap_label(swap: dict[str, str]) -> str:
    """' swap plan=tool' for a target's name; '' without swaps."""
    pairs = sorted({tuple(sorted(p)) for p in swap.items()})
    return "".join(f" swap {a}={b}" for a, b in pairs)


def _log_line(progress: Progress, bar: Any, name: str, started: float, printed: list) -> None:
    """In a log: the first episode, then a line every 30 s and the last, each with its ETA:
    `base: episodes 12/64, 40 s, ETA 2 min 53 s`."""
    task = next(t for t in progress.tasks if t.id == bar)
    done, total, now = int(task.completed), int(task.total or 0), time.perf_counter()
    if done not in (1, total) and now - printed[0] < 30.0:
        return
    printed[0] = now
    left = (now - started) / done * (total - done)
    progress.console.print(
        f"{name}: episodes {done}/{total}, {now - started:.0f} s, ETA {left:.0f} s"
    )
