"""Does greedy decoding give the same answers however requests are batched, and at what cost?

The prompts are the quickstart's greedy validation: the tool agent's prompts for the 32
held-out plan-path tasks (~290 tokens each, one shared system prompt), 24 new tokens each.
Each mode (the engine's default, and `batch_invariant`) runs in its own process and answers
them four ways: all 32 at once, one at a time, in reverse order, and in waves of 5 sent
30 ms apart. The table counts the prompts whose answer (tokens, log-probs) differs from the
all-at-once run, and times the all-at-once run (median of `--repeats`). Run:

    python bench/batch_invariant.py               # the fastest kernel set this CPU runs
    python bench/batch_invariant.py --isa avx2    # as on a CPU without AVX-512
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time

from engine import ISA_ENVIRONMENT, cpu_model
from rich.console import Console
from rich.table import Table

from masenvs.cache import DEFAULT_MODEL

MODES = {"default": False, "batch-invariant": True}
WAYS = ("all at once", "one at a time", "reversed", "waves of 5")


def _measure(invariant: bool, model: str, tasks: int, repeats: int, pipe) -> None:
    try:
        import masenvs
        from masenvs.engine import kernels as cpu_kernels
        from masenvs.engine.engine import EmbeddedBackend
        from masenvs.engine.protocol import GenerateRequest, SamplingParams

        env = masenvs.make(
            "plan_path", size=4, obstacle_ratio=0.1, tool_task="propose", show_offset=True
        )
        prompts = [env.reset(seed=1_000_000 + i)[1]["tool"]["messages"] for i in range(tasks)]
        engine = EmbeddedBackend.from_spec(model, batch_invariant=invariant)
        params = SamplingParams(max_tokens=24, temperature=0.0)

        async def answer(i: int) -> tuple[list[int], list[float]]:
            request = GenerateRequest(model="", params=params, messages=prompts[i])
            choice = (await engine.generate(request)).completions[0]
            return choice.token_ids, choice.logprobs

        async def together(order: list[int]) -> dict[int, tuple]:
            return dict(zip(order, await asyncio.gather(*(answer(i) for i in order))))

        async def waves() -> dict[int, tuple]:
            async def wave(start: int) -> list:
                await asyncio.sleep(0.03 * start / 5)
                return await asyncio.gather(
                    *(answer(i) for i in range(start, min(start + 5, tasks)))
                )

            results = await asyncio.gather(*(wave(s) for s in range(0, tasks, 5)))
            return dict(enumerate(a for batch in results for a in batch))

        async def run() -> tuple[dict, list[float]]:
            await together(list(range(4)))  # warm-up
            seconds = []
            for _ in range(repeats):
                engine.reset_prefix_cache()
                start = time.perf_counter()
                reference = await together(list(range(tasks)))
                seconds.append(time.perf_counter() - start)
            answers = {
                "all at once": reference,
                "one at a time": {i: await answer(i) for i in range(tasks)},
                "reversed": await together(list(range(tasks))[::-1]),
                "waves of 5": await waves(),
            }
            return answers, seconds

        answers, seconds = asyncio.run(run())
        engine.shutdown()
        reference = answers["all at once"]
        differ = {
            way: (
                sum(got[i][0] != reference[i][0] for i in reference),
                sum(got[i][1] != reference[i][1] for i in reference),
            )
            for way, got in answers.items()
        }
        pipe.send((cpu_kernels.kernel_set() or "torch", differ, seconds))
    except BaseException as exc:  # shown by the parent
        pipe.send(RuntimeError(f"{exc!r}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tasks", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--isa", choices=list(ISA_ENVIRONMENT), default="native")
    args = parser.parse_args()
    os.environ.update(ISA_ENVIRONMENT[args.isa])  # inherited by the spawned processes

    context = multiprocessing.get_context("spawn")
    results = {}
    for name, invariant in MODES.items():
        parent, child = context.Pipe()
        process = context.Process(
            target=_measure, args=(invariant, args.model, args.tasks, args.repeats, child)
        )
        process.start()
        reply = parent.recv()
        process.join()
        if isinstance(reply, BaseException):
            raise SystemExit(f"{name}: {reply}")
        results[name] = reply

    kernels = {kernel for kernel, _, _ in results.values()}
    table = Table(
        title=f"{args.model}, {args.tasks} plan-path validation prompts, greedy, 24 new tokens "
        f"({cpu_model()}, {os.cpu_count()} CPUs, isa {args.isa}, kernels {', '.join(kernels)})\n"
        "answers that differ from the all-at-once run: tokens / log-probs"
    )
    for column in ("mode", *WAYS[1:], "all at once (s, median)", "vs default"):
        table.add_column(column, justify="right")
    base = statistics.median(results["default"][2])
    for name, (_, differ, seconds) in results.items():
        cells = [f"{differ[way][0]} / {differ[way][1]}" for way in WAYS[1:]]
        wall = statistics.median(seconds)
        table.add_row(name, *cells, f"{wall:.2f}", f"{wall / base:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
