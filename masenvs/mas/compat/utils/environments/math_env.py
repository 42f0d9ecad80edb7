"""MathEnvironment: the Python tool, run in a fresh sandbox process (through the gate)."""

from __future__ import annotations

from typing import Any


def python_execute(code: str) -> str:
    """Run `code` in the sandbox; the output, or why it failed, as text."""
    from masenvs.mas.llm import current

    try:
        llm = current()
    except RuntimeError:  # outside a design: a local sandbox
        llm = None
    if llm is not None and llm.gate is not None:
        return llm.execute_python_sync(code)
    from masenvs.mas.tools import run_python

    return run_python(code).observation()


python_execute.masenvs_sandboxed_python = True  # type: ignore[attr-defined]


class MathEnvironment:
    """`execute(code)` runs Python in the sandbox. `timeout` and `work_dir` are accepted;
    the sandbox's limits apply (masenvs.mas.tools) and every run starts from an empty
    directory."""

    def __init__(self, timeout: int = 120, work_dir: str | None = None, **kwargs: Any) -> None:
        self.timeout, self.work_dir = timeout, work_dir

    def execute(self, code: str) -> str:
        return python_execute(code)

    execute.masenvs_sandboxed_python = True  # type: ignore[attr-defined]
