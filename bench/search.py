"""BM25 queries per second on a synthetic encyclopedia: bm25s (the web_search env's embedded
backend) against a plain-Python BM25 (inverted index and a heap), same tokens, same scores.

Run: python bench/search.py [--docs 100000] [--queries 2000] [--repeats 3] [--budget 10]
Figures depend on the machine and its load; compare the rows of one run, not across runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from masenvs.search import BM25Backend, PlainBM25, generate_encyclopedia, generate_tasks


def cpu_name() -> str:
    """The CPU model and whether it has AVX2/AVX-512 (Linux), else platform's guess."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        model = next(
            line.split(":", 1)[1].strip() for line in info.splitlines() if "model name" in line
        )
        flags = next(line for line in info.splitlines() if line.startswith("flags")).split()
        simd = [f for f in ("avx2", "avx512f") if f in flags]
        return f"{model} ({', '.join(simd) or 'no AVX2'}), {os.cpu_count()} CPUs"
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def bench_bm25(
    docs: int = 100_000,
    queries: int = 2000,
    repeats: int = 3,
    console: Console | None = None,
    budget: float = 10.0,
) -> None:
    console = console or Console()
    started = time.perf_counter()
    book = generate_encyclopedia(docs, seed=0)
    tasks = generate_tasks(book, queries // 2, 1, 4, seed=1)
    # Half whole questions (long), half one hop's keywords (short), as agents write them
    # (interleaved, so a pass cut short by its time budget sees both kinds)
    texts = [
        text
        for t in tasks
        for text in (t.question, f"{t.chain[0][1].replace('_', ' ')} {t.chain[0][0]}")
    ]
    console.print(
        f"corpus: {len(book.docs):,} documents, {len(texts):,} queries (built in {time.perf_counter() - started:.1f}s)"
    )
    table = Table(title=f"BM25 top-10, median of {repeats} (CPU: {cpu_name()})")
    for column in ("implementation", "index build s", "queries/s", "vs plain"):
        table.add_column(column, justify="left" if column == "implementation" else "right")
    results, rows = {}, {}
    built = {}
    for cls in (BM25Backend, PlainBM25):
        t0 = time.perf_counter()
        built[cls] = (cls(book.docs), time.perf_counter() - t0)
    cases = {
        "bm25s, one query per call": (BM25Backend, 1),
        "bm25s, 64 queries per call": (BM25Backend, 64),
        "plain Python BM25": (PlainBM25, 1),
    }
    for name, (cls, batch) in cases.items():
        backend, build = built[cls]
        rates = []
        for _ in range(repeats):  # each pass stops after `budget` seconds
            out: list = []
            t0 = time.perf_counter()
            while len(out) < len(texts) and time.perf_counter() - t0 < budget:
                out += backend.search(texts[len(out) : len(out) + batch], 10)
            rates.append(len(out) / (time.perf_counter() - t0))
        results[name], rows[name] = out, (build, statistics.median(rates))
    fast, plain = results["bm25s, 64 queries per call"], results["plain Python BM25"]
    pairs = list(zip(fast, plain))  # the queries both answered
    agree = sum(bool(a) and bool(b) and a[0].id == b[0].id for a, b in pairs) / len(pairs)
    base = rows["plain Python BM25"][1]
    for name, (build, rate) in rows.items():
        table.add_row(name, f"{build:.1f}", f"{rate:,.0f}", f"{rate / base:.1f}x")
    console.print(table)
    console.print(
        f"same top document for {agree:.1%} of {len(pairs)} queries (the rest: ties in score); "
        f"each pass stops after {budget:.0f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=float, default=10.0, help="seconds per timed pass")
    args = parser.parse_args()
    console = Console()
    console.print(f"Python {sys.version.split()[0]}")
    bench_bm25(args.docs, args.queries, args.repeats, console, args.budget)


if __name__ == "__main__":
    main()
