"""Rollout throughput with the env episodes in the trainer process and on 1 and 2 Ray rollout
workers, and what the router in front of the engines adds per call.

One embedded engine serves the capture endpoint in this process, as in training. Each mode
plays the same task seeds as tree rollouts (`collect_tree_batch`, K branches per turn), at
the same total concurrency (`rollout.concurrency` is split over the workers), repeats
interleaved so drift hits every mode alike; the table shows medians. Worker start-up is
timed apart and not counted. The router line times a call through the `EnginePool` of two
replicas (the router in front of several engines, `bench/scale_router.py`) against the same
call straight to one, on a backend that answers at once, so only the routing is measured.

    python bench/scale.py                          # tiny model, 16 tasks, 3 repeats
    python bench/scale.py --model smollm2-135m --tasks 8 --max-tokens 24
    python bench/scale.py --workers                # the router line only
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import time

import ray
from rich.console import Console
from rich.table import Table
from scale_router import router_overhead  # bench/ is this script's import path

from masenvs.adapters.policy import ChatPolicy, Sampling
from masenvs.adapters.stack import Stack, start_stack
from masenvs.trainer.config import DistributedConfig, TrainConfig, load_config
from masenvs.trainer.rollout.sources import env_factory, env_options
from masenvs.trainer.rollout.tree import TaskRollout, collect_tree_batch
from masenvs.trainer.rollout.workers import RolloutPool, worker_spec


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    flags = fields.get("Flags", "").split()
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}, {fields.get('CPU(s)', '?').strip()} CPUs ({', '.join(isa) or 'no AVX2'})"


def config(args: argparse.Namespace) -> TrainConfig:
    return load_config(
        None,
        [
            f"model.name={args.model}",
            f"env.name={args.env}",
            f"rollout.branches={args.branches}",
            f"rollout.max_rounds={args.max_rounds}",
            f"rollout.max_tokens={args.max_tokens}",
            f"rollout.concurrency={args.concurrency}",
        ],
    )


async def in_process(stack: Stack, cfg: TrainConfig, seeds: list[int]) -> list[TaskRollout]:
    policy = trainer_policy(stack, cfg)
    try:
        return await collect_tree_batch(
            env_factory(cfg, stack),
            seeds,
            policy,
            branches=cfg.rollout.branches,
            policy_of=lambda agent: agent,
            rollout_prefix="bench",
            concurrency=cfg.rollout.concurrency,
        )
    finally:
        await policy.aclose()


def trainer_policy(stack: Stack, cfg: TrainConfig) -> ChatPolicy:
    r = cfg.rollout
    return ChatPolicy(stack.root_url, sampling=Sampling(r.temperature, r.top_p, 0, r.max_tokens))


def rollout_rows(args: argparse.Namespace, console: Console) -> list[list[str]]:
    cfg = config(args)
    stack = start_stack(model=args.model, max_batch_size=args.max_batch_size)
    agents = env_factory(cfg)().possible_agents
    pools: dict[int, RolloutPool] = {}
    started: dict[int, float] = {}
    ray.init(
        num_cpus=sum(args.workers) + 1,
        include_dashboard=False,
        object_store_memory=200 * 2**20,
        log_to_driver=False,
    )
    try:
        for n in args.workers:
            if n:
                t = time.perf_counter()
                dist = DistributedConfig(rollout_workers=n)
                spec = worker_spec(
                    cfg.model_copy(update={"distributed": dist}),
                    stack,
                    trainer_policy(stack, cfg),
                    {a: a for a in agents},
                    env_options(cfg),
                )
                pools[n] = RolloutPool(spec, dist)
                started[n] = time.perf_counter() - t

        def play(n: int, seeds: list[int]) -> tuple[float, list[TaskRollout]]:
            t = time.perf_counter()
            if n == 0:
                results = asyncio.run(in_process(stack, cfg, seeds))
            else:
                results = pools[n].tree(f"bench{n}-{seeds[0]}", seeds)
            return time.perf_counter() - t, results

        for n in args.workers:  # warm-up: the engine's first batches, the workers' imports
            play(n, list(range(10_000, 10_000 + min(args.tasks, 4))))
        runs: dict[int, list[tuple[float, float]]] = {n: [] for n in args.workers}
        for rep in range(args.repeats):
            seeds = list(range(rep * args.tasks, (rep + 1) * args.tasks))
            for n in args.workers:
                seconds, results = play(n, seeds)
                failed = [r.error for r in results if r.error]
                if failed:
                    raise SystemExit(f"{len(failed)} task(s) failed with {n} workers: {failed[0]}")
                tokens = sum(r.completion_tokens for r in results)
                runs[n].append((len(results) / seconds, tokens / seconds))
                console.print(
                    f"repeat {rep + 1}/{args.repeats}, {n} workers: {seconds:.2f}s, {tokens} tokens"
                )
    finally:
        for pool in pools.values():
            pool.close()
        ray.shutdown()
        stack.close()
    base = statistics.median(e for e, _ in runs[args.workers[0]])
    rows = []
    for n in args.workers:
        eps = statistics.median(e for e, _ in runs[n])
        tps = statistics.median(t for _, t in runs[n])
        seconds = sorted(args.tasks / e for e, _ in runs[n])
        rows.append(
            [
                "in-process" if n == 0 else f"{n} worker{'s' * (n > 1)}",
                "-" if n == 0 else f"{started[n]:.1f}",
                f"{eps:.2f}",
                f"{tps:.0f}",
                f"{eps / base:.2f}x",
                ", ".join(f"{t:.1f}" for t in seconds),
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--env", default="plan_path")
    parser.add_argument("--tasks", type=int, default=16, help="tasks (seeds) per batch")
    parser.add_argument("--branches", type=int, default=2)
    parser.add_argument("--max-rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8, help="tasks in flight, in all")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--workers", type=int, nargs="*", default=[0, 1, 2], help="0: in-process; none: skip"
    )
    parser.add_argument("--router-calls", type=int, default=20_000)
    args = parser.parse_args()
    console = Console()
    cpu = cpu_name()
    if args.workers:
        rows = rollout_rows(args, console)
        table = Table(
            title=f"tree rollouts of {args.env}, {args.model}, {args.tasks} tasks x "
            f"{args.branches} branches, median of {args.repeats} ({cpu})"
        )
        columns = ("episodes run", "worker start s", "episodes/s", "tokens/s", "vs first")
        for column in (*columns, "seconds per batch"):
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    router = router_overhead(args.router_calls)
    console.print(
        f"router: {router['direct_p50_us']:.1f} us/call direct, {router['pool_p50_us']:.1f} "
        f"us/call through a 2-engine EnginePool: {router['overhead_p50_us']:+.1f} us per call "
        f"(p50; {cpu})"
    )
    from scale_router import router_overhead as pool_overhead  # bench/ is on sys.path

    pool = pool_overhead(args.router_calls)
    console.print(
        f"engine pool: {pool['direct_p50_us']:.2f} us/call direct, {pool['pool_p50_us']:.2f} "
        f"us/call through a 2-replica EnginePool (p50): {pool['overhead_p50_us']:+.2f} us per "
        f"call ({cpu})"
    )
    console.print(
        "note: the engine (torch threads), the endpoint and the workers share this machine's "
        "cores; workers add processes, not cores, so here they can only show their overhead."
    )


if __name__ == "__main__":
    main()
