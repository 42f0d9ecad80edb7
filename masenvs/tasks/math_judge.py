"""Is this answer right? `\\boxed{}` extraction and math-verify equivalence with a hard bound.

Plain numbers (integers, fractions, `\\frac{a}{b}`) are compared exactly in-process; anything
else goes to math-verify in a worker process (`_verify_worker.py`) that is killed when it
runs past `timeout` (sympy can hang on inputs like `9^{9^{9^9}}`), so a call never blocks
longer than that, from any thread.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

from masenvs.parsing import last_boxed

_WORKER = str(Path(__file__).with_name("_verify_worker.py"))

# --- extraction -----------------------------------------------------------------------------


def printed_answer(stdout: str) -> str | None:
    """A program's answer: a `\\boxed{}` in its output, else its last non-empty line."""
    boxed = last_boxed(stdout)
    if boxed is not None:
        return boxed
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    return lines[-1] if lines else None


def normalize(answer: str) -> str:
    """Strip math delimiters, a `\\boxed{}` wrapper and trailing punctuation."""
    text = answer.strip()
    boxed = last_boxed(text)
    if boxed is not None and text.startswith(("\\boxed", "$\\boxed", "\\fbox")):
        text = boxed
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if text.startswith(left) and text.endswith(right) and len(text) >= len(left + right):
            text = text[len(left) : len(text) - len(right)].strip()
    return text.rstrip(".").strip()


# --- exact fast path ------------------------------------------------------------------------

_INT = re.compile(r"[+-]?\d+")
_DECIMAL = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)")
_SLASH = re.compile(r"([+-]?\d+)\s*/\s*([+-]?\d+)")
_LATEX_FRAC = re.compile(r"([+-]?)\\[dt]?frac\{\s*([+-]?\d+)\s*\}\{\s*([+-]?\d+)\s*\}")


def simple_number(text: str) -> tuple[Fraction, bool] | None:
    """`text` as an exact number and whether it was written exactly (no decimal point)."""
    text = text.replace(" ", "")
    if len(text) > 200:  # huge literals go to math-verify, which bounds them
        return None
    try:
        if _INT.fullmatch(text):
            return Fraction(int(text)), True
        if _DECIMAL.fullmatch(text):
            return Fraction(text), False
        if m := _SLASH.fullmatch(text):
            return Fraction(int(m[1]), int(m[2])), True
        if m := _LATEX_FRAC.fullmatch(text):
            value = Fraction(int(m[2]), int(m[3]))
            return (-value if m[1] == "-" else value), True
    except (ZeroDivisionError, ValueError):
        return None
    return None


# --- the worker pool ------------------------------------------------------------------------


class _Worker:
    """One `_verify_worker.py` process and its reply buffer."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", _WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"},
        )
        self.buffer = b""

    def ask(self, request: dict, timeout: float) -> bool | None:
        """The worker's reply, or None when it died or ran past `timeout`."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        try:
            return bool(json.loads(line)["ok"])
        except (ValueError, KeyError, TypeError):
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


class MathJudge:
    """Decides answer equivalence; safe to share between threads."""

    def __init__(self, timeout: float = 5.0, max_workers: int = 4, max_chars: int = 1000) -> None:
        self.timeout = timeout  # seconds per comparison, including a cold worker's start
        self.max_chars = max_chars  # longer answers count as unparsable
        self._idle: list[_Worker] = []
        self._pid = os.getpid()  # workers belong to the process that started them
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_workers)
        self.timeouts = 0  # comparisons cut off by `timeout` (reported, for monitoring)

    def equal(self, gold: str, pred: str | None, timeout: float | None = None) -> bool:
        """Whether `pred` is a correct answer for the reference answer `gold`."""
        return self._compare(gold, pred, symmetric=False, timeout=timeout)

    def agree(self, a: str | None, b: str | None, timeout: float | None = None) -> bool:
        """Whether two answers (neither of them a reference) state the same value."""
        if a is None:
            return False
        return self._compare(a, b, symmetric=True, timeout=timeout)

    def _compare(self, gold: str, pred: str | None, symmetric: bool, timeout: float | None) -> bool:
        if pred is None:
            return False
        gold, pred = normalize(gold), normalize(pred)
        if not gold or not pred or len(gold) > self.max_chars or len(pred) > self.max_chars:
            return False
        if gold == pred:
            return True
        exact_gold, exact_pred = simple_number(gold), simple_number(pred)
        if exact_gold and exact_pred:
            if exact_gold[0] == exact_pred[0]:
                return True
            if exact_gold[1] and exact_pred[1]:
                return False  # two exact values that differ; decimals may still round equal
        request = {"gold": gold, "pred": pred, "symmetric": symmetric}
        return self._ask(request, self.timeout if timeout is None else timeout)

    def _ask(self, request: dict, timeout: float) -> bool:
        if importlib.util.find_spec("math_verify") is None:
            raise RuntimeError(
                "checking math answers beyond plain numbers needs math-verify: "
                "pip install 'masenvs[tasks]'"
            )
        # A cold worker imports sympy first (about a second); a slow first call is not a hang.
        with self._slots:
            with self._lock:
                if self._pid != os.getpid():  # a forked copy: the pipes are the parent's
                    self._idle, self._pid = [], os.getpid()
                worker = self._idle.pop() if self._idle else None
            if worker is None:
                worker, timeout = _Worker(), timeout + 10.0
            reply = worker.ask(request, timeout)
            if reply is None:
                worker.close()
                self.timeouts += 1
                return False
            with self._lock:
                self._idle.append(worker)
            return reply

    def close(self) -> None:
        with self._lock:
            workers, self._idle = self._idle, []
        for worker in workers:
            worker.close()


_default: MathJudge | None = None
_default_lock = threading.Lock()


def default_judge() -> MathJudge:
    """The process-wide judge (its workers are shared by every math env)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathJudge()
            atexit.register(_default.close)
        return _default
