"""Run a program on test cases in the sandbox and grade each case.

Cases are split into chunks; each chunk is one sandbox run of `_harness.py`, which forks a
fresh process per case (own stdin/stdout, per-case timeout) and reports what the program
printed or returned. Chunks of all suites run in parallel through `Sandbox.run_many`;
expected outputs stay in this process and are compared here:

* stdin programs: whitespace-normalised tokens, numbers written with a decimal point or an
  exponent within `float_tolerance`;
* call-based programs: the JSON of the return value, tuples as lists, floats within
  `float_tolerance`, and (APPS convention) `x` accepted for an expected `[x]`.

An oracle suite (`Suite.oracle`: a hidden reference run on policy-written inputs) never
shares a batch with other suites, whose output a policy may read: it runs after them, and
its harness refuses to turn an input into code (`_harness.OracleGuard`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from masenvs.sandbox import Job, Sandbox, default_sandbox
from masenvs.tasks.records import TestCase

STATUSES = ("pass", "wrong", "error", "timeout", "memory", "output_limit", "skipped")


@cache
def harness_source() -> str:
    return Path(__file__).with_name("_harness.py").read_text(encoding="utf-8")


# --- comparison -----------------------------------------------------------------------------


def _float_token(token: str) -> float | None:
    if not any(ch in token for ch in ".eE") or token.lower() in ("inf", "nan", "-inf"):
        return None
    try:
        return float(token)
    except ValueError:
        return None


def outputs_match(actual: str, expected: str, float_tolerance: float = 1e-6) -> bool:
    """Printed output equals the expected text up to whitespace (and float rounding)."""
    got, want = actual.split(), expected.split()
    if got == want:
        return True
    if len(got) != len(want) or float_tolerance <= 0:
        return False
    for a, b in zip(got, want):
        if a == b:
            continue
        expected_float = _float_token(b)
        if expected_float is None:
            return False
        try:
            value = float(a)
        except ValueError:
            return False
        if not math.isclose(
            value, expected_float, rel_tol=float_tolerance, abs_tol=float_tolerance
        ):
            return False
    return True


def values_match(actual: Any, expected: Any, float_tolerance: float = 1e-6) -> bool:
    """A returned value (after a JSON round trip) equals the expected one."""
    if _equal(actual, expected, float_tolerance):
        return True
    return (
        isinstance(expected, list)
        and len(expected) == 1
        and _equal(actual, expected[0], float_tolerance)
    )


def _equal(a: Any, b: Any, tol: float) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b  # Python's rule, as the APPS and LiveCodeBench graders use: 1 == True
    if isinstance(a, int | float) and isinstance(b, int | float):
        if isinstance(a, int) and isinstance(b, int):
            return a == b
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol) or (a != a and b != b)  # NaN == NaN
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k], tol) for k in a)
    return a == b


# --- results --------------------------------------------------------------------------------


@dataclass
class CaseResult:
    """How one test case went."""

    status: str  # one of STATUSES
    actual: Any = None  # what the program printed (str) or returned; None if it did not finish
    error: str = ""  # the tail of stderr when the program failed

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    def describe(self, test: TestCase, call_based: bool = False, limit: int = 300) -> str:
        """The case as feedback: input, expected, actual (call-based values as JSON)."""

        def show(value: Any) -> str:
            text = json.dumps(value) if call_based or not isinstance(value, str) else value
            text = text.strip()
            return text if len(text) <= limit else text[:limit] + " ..."

        got = show(self.actual) if self.status in ("pass", "wrong") else self.status
        if self.status == "error" and self.error.strip():
            got += ": " + self.error.strip().splitlines()[-1][:limit]
        return f"Input: {show(test.input)}\nExpected: {show(test.output)}\nGot: {got}"


@dataclass
class SuiteResult:
    """A program's results on a list of tests, in order."""

    cases: list[CaseResult] = field(default_factory=list)

    @property
    def n_passed(self) -> int:
        return sum(c.passed for c in self.cases)

    @property
    def pass_rate(self) -> float:
        return self.n_passed / len(self.cases) if self.cases else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    def failures(self) -> list[int]:
        return [i for i, c in enumerate(self.cases) if not c.passed]


@dataclass(frozen=True)
class Suite:
    """A program and the tests to run it on."""

    code: str
    tests: tuple[TestCase, ...]
    fn_name: str | None = None  # set for call-based programs
    oracle: bool = False  # hidden code (a reference) on policy-written inputs, see the module doc


# --- the judge ------------------------------------------------------------------------------


def _output_cap(test: TestCase) -> int:
    """How much output to keep for a case: generous, but bounded by what is expected."""
    size = len(test.output) if isinstance(test.output, str) else len(json.dumps(test.output))
    return 2 * size + 4096


@dataclass
class CodeJudge:
    """Grades programs on tests in the sandbox; safe to share between threads."""

    timeout: float = 5.0  # CPU seconds per test case (wall-clock backstop: 2x + 1 s)
    stop_at_first_failure: bool = False  # cases after the first failure are not graded
    cases_per_run: int | None = None  # cases per sandbox run; None: spread over the CPUs
    float_tolerance: float = 1e-6
    memory_mb: int | None = None  # per process; None keeps the sandbox's default
    workers: int | None = None  # parallel sandbox runs; None: the number of CPUs
    sandbox: Sandbox | None = None

    def run(self, code: str, tests: Sequence[TestCase], fn_name: str | None = None) -> SuiteResult:
        """Grade one program on `tests`."""
        return self.run_many([Suite(code, tuple(tests), fn_name)])[0]

    def run_many(self, suites: Sequence[Suite]) -> list[SuiteResult]:
        """Grade several programs at once; their chunks share one parallel batch, except
        oracle suites, which run in a batch of their own after the others."""
        results = [SuiteResult() for _ in suites]
        for oracle in (False, True):
            batch = [i for i, suite in enumerate(suites) if suite.oracle == oracle]
            if batch:
                for i, result in zip(batch, self._run_batch([suites[i] for i in batch])):
                    results[i] = result
        return results

    def _run_batch(self, suites: Sequence[Suite]) -> list[SuiteResult]:
        """Grade several programs in one parallel batch of sandbox runs."""
        sandbox = self.sandbox or default_sandbox()
        sandbox.check_judging("judge programs on hidden tests")  # else they could read them
        workers = self.workers or os.cpu_count() or 2
        total = sum(len(s.tests) for s in suites)
        per_run = self.cases_per_run or max(1, math.ceil(total / workers))
        jobs: list[Job] = []
        spans: list[tuple[int, int, int]] = []  # (suite index, first case, case count)
        for index, suite in enumerate(suites):
            for start in range(0, len(suite.tests), per_run):
                chunk = suite.tests[start : start + per_run]
                jobs.append(self._job(sandbox, suite, chunk))
                spans.append((index, start, len(chunk)))
        results = [[CaseResult("skipped") for _ in s.tests] for s in suites]
        runs = sandbox.run_many(jobs, max_workers=min(workers, len(jobs))) if jobs else []
        for (index, start, count), run in zip(spans, runs):
            reported = _parse_report(run.stdout, count)
            suite = suites[index]
            for offset in range(count):
                test = suite.tests[start + offset]
                line = reported.get(offset)
                if line is None:  # the harness never got to it: the run's own verdict says why
                    if self.stop_at_first_failure and _stopped_before(reported, offset):
                        continue
                    verdict = str(run.verdict) if str(run.verdict) != "ok" else "error"
                    results[index][start + offset] = CaseResult(verdict, None, run.stderr[-500:])
                    continue
                results[index][start + offset] = self._grade(line, test, suite.fn_name)
        graded = [SuiteResult(cases) for cases in results]
        if self.stop_at_first_failure:
            for suite_result in graded:
                failed = suite_result.failures()
                if failed:
                    for i in range(failed[0] + 1, len(suite_result.cases)):
                        suite_result.cases[i] = CaseResult("skipped")
        return graded

    def _job(self, sandbox: Sandbox, suite: Suite, chunk: Sequence[TestCase]) -> Job:
        caps = [_output_cap(t) for t in chunk]
        request = {
            "code": suite.code,
            "fn_name": suite.fn_name,
            "cases": [{"input": t.input, "cap": c} for t, c in zip(chunk, caps)],
            "timeout": self.timeout,
            "stop_on_error": self.stop_at_first_failure,
            "oracle": suite.oracle,
        }
        budget = len(chunk) * (2 * self.timeout + 1.5) + 5.0  # per-case backstops + start
        limits = dataclasses.replace(
            sandbox.limits,
            wall_seconds=budget,
            cpu_seconds=budget,  # the whole tree: every case's CPU adds up
            max_output_bytes=max(sandbox.limits.max_output_bytes, 2 * sum(caps) + 65536),
            **({"memory_mb": self.memory_mb} if self.memory_mb else {}),
        )
        return Job(harness_source(), json.dumps(request), (), limits)

    def _grade(self, line: dict, test: TestCase, fn_name: str | None) -> CaseResult:
        status, output, error = line.get("status"), line.get("output", ""), line.get("stderr", "")
        if status != "ok":
            return CaseResult(status if status in STATUSES else "error", None, error)
        if fn_name is None:
            ok = outputs_match(output, str(test.output), self.float_tolerance)
            return CaseResult("pass" if ok else "wrong", output, error)
        try:
            value = json.loads(output)
        except ValueError:
            return CaseResult("error", None, "the function returned nothing readable")
        ok = values_match(value, test.output, self.float_tolerance)
        return CaseResult("pass" if ok else "wrong", value, error)


def _stopped_before(reported: dict[int, dict], offset: int) -> bool:
    """True when an earlier case of the chunk failed and the harness stopped on purpose."""
    return any(i < offset and r.get("status") != "ok" for i, r in reported.items())


def _parse_report(stdout: str, count: int) -> dict[int, dict]:
    reported: dict[int, dict] = {}
    for raw in stdout.splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # a line cut by the run's end
        if isinstance(line, dict) and isinstance(line.get("i"), int) and 0 <= line["i"] < count:
            reported[line["i"]] = line
    return reported
