"""Auto-MAS plumbing: what the sandbox and the gate cost, and how many designs run a minute.

Two backends behind the capture endpoint: `instant` (answers at once with 8 fixed tokens,
so all measured time is plumbing) and `tiny` (the tiny random model, max_tokens 8).

- Per LLM call: the same chat call with the openai client (a) from a plain subprocess
  straight to the endpoint over loopback TCP and (b) from a design running in the
  sandbox, through its Unix-socket gate. Each side times its own calls, alternately;
  medians of both sides and their difference.
- Design start: a design that makes no call (sandbox fork, preloaded imports, result line).
- Throughput: 2-agent designs (Sequential) executed `--parallel` at a time, per minute.

    python bench/auto_mas.py
    python bench/auto_mas.py --calls 200 --designs 64 --backends instant
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from endpoint import InstantBackend  # noqa: E402

from masenvs.adapters.endpoint import EndpointServer, create_app  # noqa: E402
from masenvs.engine.loading import load_tokenizer  # noqa: E402
from masenvs.mas.design import DesignRunner  # noqa: E402
from masenvs.traces import TraceStore  # noqa: E402

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]

TIMED = """
import json, time
async def solve(messages):
    llm = current()
    times = []
    for _ in range({calls}):
        start = time.perf_counter()
        await llm.client.chat.completions.create(model="executor", messages=messages, max_tokens=8)
        times.append(time.perf_counter() - start)
    return json.dumps(times)
"""
EMPTY = "async def solve(messages):\n    return 'done'\n"
PAIR = 'system = Sequential(Agent("draft"), Agent("check"))\n'


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return "unknown CPU"


DIRECT = """
import asyncio, json, sys, time
from openai import AsyncOpenAI
async def main(url, calls):
    client = AsyncOpenAI(base_url=url, api_key="-", max_retries=0)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        await client.chat.completions.create(
            model="executor", messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=8
        )
        times.append(time.perf_counter() - start)
    await client.close()
    print(json.dumps(times))
asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def direct_calls(url: str, calls: int) -> list[float]:
    """The calls from a plain subprocess (not sandboxed), as the design makes them: the
    client never shares a process (and its GIL) with the endpoint and the engine."""
    out = subprocess.run(
        [sys.executable, "-c", DIRECT, f"{url}/r/direct/v1", str(calls)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def bench(name: str, args: argparse.Namespace, console: Console) -> list[list[str]]:
    if name == "instant":
        backend = InstantBackend(load_tokenizer("tiny"))
        routes = {"executor": "base"}
    else:
        from masenvs.engine.engine import EmbeddedBackend

        backend = EmbeddedBackend.from_spec("tiny", max_batch_size=32)
        routes = {"executor": "base"}
    with tempfile.TemporaryDirectory() as tmp:
        store = TraceStore(Path(tmp) / "traces")
        server = EndpointServer(create_app(backend, store=store, policy_map=routes))
        url = server.start()
        runner = DesignRunner(url, max_calls=args.calls + 1, max_tokens=8, seconds=600)
        runner.run(EMPTY, QUESTION, "warm")  # the sandbox's zygote starts once
        direct_calls(url, 5)
        direct, gated = [], []
        for round_ in range(4):  # alternate, so drift hits both sides alike
            direct += direct_calls(url, args.calls // 4)
            run = runner.run(TIMED.format(calls=args.calls // 4), QUESTION, f"gated-{round_}")
            if not run.ok:
                raise SystemExit(f"the timed design failed: {run.error}")
            gated += json.loads(run.answer)
        starts = []
        for i in range(10):
            began = time.perf_counter()
            assert runner.run(EMPTY, QUESTION, f"empty-{i}").ok
            starts.append(time.perf_counter() - began)
        began = time.perf_counter()
        with ThreadPoolExecutor(args.parallel) as pool:
            runs = list(
                pool.map(lambda i: runner.run(PAIR, QUESTION, f"pair-{i}"), range(args.designs))
            )
        minutes = (time.perf_counter() - began) / 60
        failed = [r.error for r in runs if not r.ok]
        if failed:
            console.print(f"[red]{len(failed)} designs failed, e.g. {failed[0]}")
        server.stop()
        store.close()
    ms = lambda xs: statistics.median(xs) * 1000  # noqa: E731
    return [
        [name, "LLM call, direct (p50)", f"{ms(direct):.1f} ms", f"{len(direct)} calls"],
        [name, "LLM call, design via gate (p50)", f"{ms(gated):.1f} ms", f"{len(gated)} calls"],
        [
            name,
            "overhead per call",
            f"{ms(gated) - ms(direct):+.1f} ms",
            f"{ms(gated) / ms(direct):.2f}x",
        ],
        [name, "design start (no call, p50)", f"{ms(starts):.0f} ms", "sandbox run + result"],
        [
            name,
            "2-agent designs per minute",
            f"{(len(runs) - len(failed)) / minutes:.0f}",
            f"{args.designs} designs, {args.parallel} at a time",
        ],
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=100, help="calls per side")
    parser.add_argument("--designs", type=int, default=32, help="designs for the throughput row")
    parser.add_argument("--parallel", type=int, default=8, help="designs running at once")
    parser.add_argument("--backends", nargs="+", default=["instant", "tiny"])
    args = parser.parse_args()
    console = Console()
    rows = []
    for name in args.backends:
        rows += bench(name, args, console)
    load = os.getloadavg()[0]
    table = Table(
        title=f"auto-MAS plumbing on {cpu_name()} ({os.cpu_count()} CPUs, load {load:.1f})"
    )
    for column in ("backend", "measure", "value", "note"):
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    console.print(table)


if __name__ == "__main__":
    main()
