"""Environment-side speed: env steps, sandboxed program runs, code test cases and iverilog
judgements and BM25 queries (`--only search`, bench/search.py) per second.

Run: python bench/envs.py [--repeats 5] [--runs 100] [--only verilog|search|...]
Figures depend on the machine and its load; compare the rows of one run, not across runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from rich.console import Console
from rich.table import Table

from masenvs.sandbox import Sandbox, SandboxLimits

SHORT_PROGRAM = "print(sum(range(1000)))"
EXPECTED = "499500\n"


def _rate(fn: Callable[[], list[str]], runs: int, repeats: int) -> float:
    """Median runs per second of `fn` (which does `runs` runs) over `repeats` repeats."""
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = fn()
        rates.append(runs / (time.perf_counter() - start))
        if outputs != [EXPECTED] * runs:  # a fast wrong answer is not a result
            raise RuntimeError(f"unexpected output: {outputs[:3]!r}")
    return statistics.median(rates)


def _naive(src: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", src], capture_output=True, text=True, timeout=10
    ).stdout


def bench_sandbox(repeats: int = 5, runs: int = 100, console: Console | None = None) -> None:
    """Sandbox runs/s against a naive `subprocess.run([python, -c, src])`, serial and parallel."""
    console = console or Console()
    workers = (os.cpu_count() or 2) * 2
    sandbox = Sandbox(SandboxLimits())
    sandbox.run(SHORT_PROGRAM)  # start the server outside the timing
    pool = ThreadPoolExecutor(workers)
    cases = {
        "serial": (
            lambda: [sandbox.run(SHORT_PROGRAM).stdout for _ in range(runs)],
            lambda: [_naive(SHORT_PROGRAM) for _ in range(runs)],
        ),
        f"parallel ({workers} threads)": (
            lambda: [r.stdout for r in sandbox.run_many([(SHORT_PROGRAM, "")] * runs, workers)],
            lambda: list(pool.map(_naive, [SHORT_PROGRAM] * runs)),
        ),
    }
    table = Table(title=f"sandbox: {SHORT_PROGRAM!r}, median of {repeats} x {runs} runs")
    for column in ("mode", "sandbox runs/s", "subprocess runs/s", "ratio"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode, (ours, naive) in cases.items():
        a, b = _rate(ours, runs, repeats), _rate(naive, runs, repeats)
        table.add_row(mode, f"{a:.0f}", f"{b:.0f}", f"{a / b:.1f}x")
    pool.shutdown()
    isolation = sandbox.isolation
    sandbox.close()
    console.print(table)
    console.print(f"isolation: {isolation}", highlight=False)


def bench_code_tests(repeats: int = 5, console: Console | None = None) -> None:
    """Code-env test cases/s: the judge against a fresh `subprocess.run` per test case.

    Same cases both ways: every built-in problem's reference solution on its hidden and
    public tests, graded with the same comparison; both sides use one worker per CPU.
    """
    import json

    from masenvs.tasks.code_judge import CodeJudge, Suite, outputs_match, values_match
    from masenvs.tasks.code_problems import PROBLEMS

    console = console or Console()
    workers = os.cpu_count() or 2
    suites = [Suite(p.reference_solution, p.tests + p.public_tests, p.fn_name) for p in PROBLEMS]
    cases = [(s, t) for s in suites for t in s.tests]
    call = "\nimport json, sys\n_f = {0} if {0!r} in globals() else getattr(Solution(), {0!r})\n"
    call += "print(json.dumps(_f(*json.loads(sys.stdin.read()))))\n"
    preamble = "from typing import *\nfrom collections import *\n"

    def naive_case(case: tuple[Suite, object]) -> bool:
        suite, test = case
        if suite.fn_name is None:
            src, stdin = suite.code, test.input
        else:
            src, stdin = preamble + suite.code + call.format(suite.fn_name), json.dumps(test.input)
        done = subprocess.run(
            [sys.executable, "-c", src], input=stdin, capture_output=True, text=True, timeout=10
        )
        if suite.fn_name is None:
            return outputs_match(done.stdout, test.output)
        return values_match(json.loads(done.stdout), test.output)

    def rate(fn: Callable[[], list[bool]]) -> float:
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            passed = fn()
            rates.append(len(cases) / (time.perf_counter() - start))
            if not all(passed):  # a fast wrong grade is not a result
                raise RuntimeError(f"{passed.count(False)} reference cases failed")
        return statistics.median(rates)

    chunked, per_case = CodeJudge(workers=workers), CodeJudge(workers=workers, cases_per_run=1)
    chunked.run_many(suites[:1])  # start the sandbox server outside the timing
    pool = ThreadPoolExecutor(workers)
    rows = {
        "judge, cases chunked per run (default)": lambda: [
            c.passed for r in chunked.run_many(suites) for c in r.cases
        ],
        "judge, one sandbox run per case": lambda: [
            c.passed for r in per_case.run_many(suites) for c in r.cases
        ],
        "subprocess.run per case": lambda: list(pool.map(naive_case, cases)),
    }
    rates = {name: rate(fn) for name, fn in rows.items()}
    pool.shutdown()
    base = rates["subprocess.run per case"]
    table = Table(
        title=f"code env: {len(cases)} test cases of {len(suites)} problems, "
        f"{workers} workers, median of {repeats}"
    )
    for column in ("runner", "cases/s", "vs subprocess.run"):
        table.add_column(column, justify="left" if column == "runner" else "right")
    for name, value in rates.items():
        table.add_row(name, f"{value:.0f}", f"{value / base:.1f}x")
    console.print(table)


def bench_verilog(repeats: int = 3, console: Console | None = None) -> None:
    """Verilog judgements/s: each golden module of our problems compiled with iverilog and
    simulated on its hidden vectors, in the sandbox (serial and one thread per CPU) against
    iverilog + vvp run directly with no sandbox."""
    import tempfile

    from masenvs.tasks.verilog_judge import Sim, SimResult, VerilogJudge, compare, testbench
    from masenvs.tasks.verilog_problems import builtin_tasks

    console = console or Console()
    workers = os.cpu_count() or 2
    tasks = builtin_tasks()
    judge = VerilogJudge()
    judge.check_design(tasks[0], tasks[0].golden)  # start the sandbox server outside the timing

    def judged(task: object) -> bool:
        return judge.check_design(task, task.golden).status == "pass"

    def direct(task: object) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            design, tb, sim = (os.path.join(tmp, n) for n in ("design.v", "tb.v", "sim.vvp"))
            with open(design, "w") as f:
                f.write(task.golden)
            with open(tb, "w") as f:
                f.write(testbench(task, [task.vectors], "@m"))
            subprocess.run(["iverilog", "-g2012", "-o", sim, tb, design], check=True)
            out = subprocess.run(["vvp", "-n", sim, "+seq=0"], capture_output=True, text=True)
        rows = [
            tuple(ln.split()[2:]) for ln in out.stdout.splitlines() if ln.split()[1:2] != ["done"]
        ]
        return compare(SimResult("ok", "", [rows]), 0, task.vectors, task.expected).status == "pass"

    pool = ThreadPoolExecutor(workers)
    rows = {
        "judge (sandbox), serial": lambda: [judged(t) for t in tasks],
        f"judge (sandbox), {workers} threads": lambda: list(pool.map(judged, tasks)),
        "judge (sandbox), all in one run": lambda: [
            compare(r, 0, t.vectors, t.expected).status == "pass"
            for t, r in zip(tasks, judge.simulate([Sim(t, t.golden, (t.vectors,)) for t in tasks]))
        ],
        "iverilog + vvp directly, serial": lambda: [direct(t) for t in tasks],
        f"iverilog + vvp directly, {workers} threads": lambda: list(pool.map(direct, tasks)),
    }
    table = Table(
        title=f"verilog: {len(tasks)} golden designs on {sum(len(t.vectors) for t in tasks)} "
        f"hidden vectors, median of {repeats}"
    )
    for column in ("runner", "judgements/s", "ms each"):
        table.add_column(column, justify="left" if column == "runner" else "right")
    for name, fn in rows.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            passed = fn()
            times.append(time.perf_counter() - start)
            if not all(passed):  # a fast wrong judgement is not a result
                raise RuntimeError(f"{name}: {passed.count(False)} goldens failed")
        rate = len(tasks) / statistics.median(times)
        table.add_row(name, f"{rate:.1f}", f"{1000 / rate:.0f}")
    pool.shutdown()
    console.print(table)


def bench_env_steps(repeats: int = 5, console: Console | None = None, steps: int = 200) -> None:
    """Env steps/s per task with canned text answers (no LLM, no tool code), and the
    snapshot + restore pairs/s the tree sampler does before every branch."""
    import masenvs

    answers = ["#### [R, D, 1, 2]", "\\boxed{3}", "no answer here"]
    table = Table(title="env steps (no LLM, no sandboxed code)")
    for column in ("env", "agents", "steps/s", "snapshot+restore/s"):
        table.add_column(column, justify="right")
    for name in masenvs.list_envs():
        env = masenvs.make(name)

        def play(env: masenvs.MASEnv = env) -> None:
            env.reset(seed=0)
            for i in range(steps):
                if not env.agents:
                    env.reset(seed=i)
                env.step({a: answers[i % len(answers)] for a in env.agents})

        def branch(env: masenvs.MASEnv = env) -> None:
            env.reset(seed=0)
            for _ in range(steps):
                env.restore(env.snapshot())

        rates = []
        for fn in (play, branch):
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            rates.append(steps / statistics.median(times))
        table.add_row(name, str(len(env.possible_agents)), f"{rates[0]:,.0f}", f"{rates[1]:,.0f}")
    (console or Console()).print(table)


def bench_search(console: Console) -> None:
    """BM25 queries/s on a 100k-document synthetic corpus, bm25s beside a plain Python BM25
    (bench/search.py, which takes the corpus size and query count as options)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from search import bench_bm25

    bench_bm25(console=console)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument(
        "--only",
        choices=["sandbox", "code", "verilog", "search", "steps"],
        help="run one benchmark",
    )
    args = parser.parse_args()
    console = Console()
    console.print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    benches = {
        "sandbox": lambda: bench_sandbox(args.repeats, args.runs, console),
        "code": lambda: bench_code_tests(args.repeats, console),
        "verilog": lambda: bench_verilog(args.repeats, console),
        "search": lambda: bench_search(console),
        "steps": lambda: bench_env_steps(args.repeats, console),
    }
    for name, bench in benches.items():
        if args.only in (None, name):
            bench()


if __name__ == "__main__":
    main()
