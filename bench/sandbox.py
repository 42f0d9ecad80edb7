"""Sandbox speed: short programs per second, serially and in parallel, with the CPU a run
costs; optionally against another tree's sandbox (e.g. the commit before the allow-list)
and against a fresh bubblewrap + interpreter per run, on the same machine, in one run.

Run: python bench/sandbox.py [--runs 100] [--repeats 5] [--before /tmp/old-worktree]
     [--bwrap-per-run]
The target (docs/sandbox.md): at least 50 short programs/s serially on 2 cores. Each tree
runs in its own process (its own `masenvs`); repeats alternate between trees, so load on a
shared machine hits both alike. Compare rows of one run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
SHORT_PROGRAM = "print(sum(range(1000)))"
EXPECTED = "499500\n"

# Runs in a child process whose PYTHONPATH starts with the tree under test.
WORKER = r"""
import json, os, resource, sys, time
from masenvs.sandbox import Sandbox, SandboxLimits
runs, mode = int(sys.argv[1]), sys.argv[2]
sandbox = Sandbox(SandboxLimits())
sandbox.run("print(1)")  # start the server outside the timing
def cpu():  # ours and every reaped descendant's (server, supervisors, programs)
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
start, cpu0 = time.perf_counter(), cpu()
if mode == "serial":
    outs = [sandbox.run(SHORT).stdout for _ in range(runs)]
else:
    outs = [r.stdout for r in sandbox.run_many([(SHORT, "")] * runs, 4)]
wall = time.perf_counter() - start
iso = sandbox.isolation
sandbox.close()  # reaps the server: its CPU counts in RUSAGE_CHILDREN
print(json.dumps({"rate": runs / wall, "cpu_ms": 1000 * (cpu() - cpu0) / runs,
                  "ok": outs == [EXPECTED] * runs, "mode": iso.mode,
                  "allow_list": getattr(iso, "allow_list", False)}))
"""


def measure(tree: Path, runs: int, mode: str) -> dict:
    """One timing of `runs` short programs with the sandbox of `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    script = f"SHORT = {SHORT_PROGRAM!r}\nEXPECTED = {EXPECTED!r}\n{WORKER}"
    out = subprocess.run(
        [sys.executable, "-c", script, str(runs), mode],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the bench of {tree} failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.splitlines()[-1])
    if not result["ok"]:
        raise RuntimeError(f"{tree}: a run printed something else than {EXPECTED!r}")
    return result


def bwrap_per_run(runs: int) -> float:
    """Runs/s of a fresh bubblewrap root (the same allow-list) and interpreter per program."""
    from masenvs.sandbox.client import bwrap_command

    command, _ = bwrap_command((), (), (), [])
    bwrap_args = command[: command.index("--") + 1]
    start = time.perf_counter()
    for _ in range(runs):
        out = subprocess.run(
            [*bwrap_args, sys.executable, "-I", "-c", SHORT_PROGRAM],
            capture_output=True,
            text=True,
            env={"PATH": "/usr/bin:/bin"},
        )
        if out.stdout != EXPECTED:
            raise RuntimeError(f"bwrap per run failed: {out.stderr[-500:]}")
    return runs / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another tree to compare (a git worktree)")
    parser.add_argument("--bwrap-per-run", action="store_true", help="also time bwrap per run")
    args = parser.parse_args()
    trees = {"this tree": ROOT}
    if args.before:
        trees = {"before": args.before.resolve(), **trees}
    console = Console()
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.repeats):
        for mode in ("serial", "parallel"):
            for name, tree in trees.items():
                results.setdefault((name, mode), []).append(measure(tree, args.runs, mode))
    table = Table(title=f"sandbox: {SHORT_PROGRAM!r}, median of {args.repeats} x {args.runs} runs")
    for column in ("tree", "mode", "isolation", "runs/s", "CPU ms/run"):
        table.add_column(column, justify="right" if "/" in column else "left")
    for (name, mode), rows in results.items():
        iso = f"{rows[0]['mode']}{', allow-list' if rows[0]['allow_list'] else ''}"
        rate = statistics.median(r["rate"] for r in rows)
        cpu = statistics.median(r["cpu_ms"] for r in rows)
        table.add_row(name, mode, iso, f"{rate:.0f}", f"{cpu:.1f}")
    if args.bwrap_per_run:
        table.add_row("bwrap + python per run", "serial", "", f"{bwrap_per_run(args.runs):.0f}", "")
    console.print(table)
    with open("/proc/loadavg") as f:
        console.print(f"load average: {f.read().split()[:3]}, cpus: {os.cpu_count()}")


if __name__ == "__main__":
    main()
