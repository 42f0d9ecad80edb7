"""The Python tool of tool-using agent nodes: a program an agent wrote, run in the sandbox.

Every run is a fresh sandbox process (no network, its own uid, time, memory and output
limits; see masenvs/sandbox/), so nothing carries from one run to the next. What comes
back is text for the model to read: the program's output, or why it failed.

Inside a design's sandbox the code cannot start a sandbox of its own: `LLM.execute_python`
sends it to the design's gate instead, which calls `run_python` here, outside.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Any

TOOL_SECONDS = 10.0  # wall seconds of one run (and CPU seconds)
TOOL_MEMORY_MB = 1024
TOOL_OUTPUT_BYTES = 16 << 10  # per stream, what the sandbox keeps
SHOWN_CHARS = 2000  # what the model is shown of each stream
MAX_CODE_CHARS = 100_000
# Modules a tool program is likely to import, loaded once by the tool sandbox's zygote.
PRELOAD = ("fractions", "decimal", "itertools", "math", "statistics", "functools")


@dataclass
class ToolResult:
    """One run of the Python tool."""

    verdict: str  # the sandbox's: ok, error, timeout, memory, output_limit
    stdout: str
    stderr: str
    returncode: int | None = None  # the program's exit status (None: it never ran)

    def observation(self) -> str:
        """What the agent is shown: the output, or the error and its cause."""
        out = _clip(self.stdout)
        if self.verdict == "ok":
            return f"Output:\n{out}" if out.strip() else "The code ran and printed nothing."
        if self.verdict == "timeout":
            return f"Timeout: the code ran past {TOOL_SECONDS:g} s.\nOutput so far:\n{out}"
        if self.verdict == "memory":
            return f"Memory: the code went over {TOOL_MEMORY_MB} MB."
        if self.verdict == "output_limit":
            return f"Output limit: the code printed too much.\nFirst part:\n{out}"
        err = _tail(self.stderr) or "(no message)"
        return f"Error:\n{err}" + (f"\nOutput before the error:\n{out}" if out.strip() else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "returncode": self.returncode,
        }


_sandbox: Any = None
_lock = threading.Lock()


def tool_sandbox() -> Any:
    """The sandbox tool programs run in (shared, started on first use)."""
    global _sandbox
    from masenvs.sandbox import DEFAULT_PRELOAD, Sandbox, SandboxLimits

    with _lock:
        if _sandbox is None:
            limits = SandboxLimits(
                cpu_seconds=TOOL_SECONDS,
                wall_seconds=TOOL_SECONDS,
                memory_mb=TOOL_MEMORY_MB,
                max_output_bytes=TOOL_OUTPUT_BYTES,
            )
            _sandbox = Sandbox(limits, preload=tuple(dict.fromkeys((*DEFAULT_PRELOAD, *PRELOAD))))
        return _sandbox


def run_python(code: str, seconds: float | None = None) -> ToolResult:
    """Run `code` as a program in a fresh sandbox process; never raises on bad code."""
    if not isinstance(code, str):
        return ToolResult("error", "", f"the code must be text, got {type(code).__name__}")
    if len(code) > MAX_CODE_CHARS:
        return ToolResult("error", "", f"the code is over {MAX_CODE_CHARS} characters")
    sandbox = tool_sandbox()
    limits = sandbox.limits
    if seconds is not None:
        seconds = max(0.1, min(float(seconds), TOOL_SECONDS))
        limits = replace(limits, wall_seconds=seconds, cpu_seconds=seconds)
    result = sandbox.run(code, limits=limits)
    return ToolResult(str(result.verdict), result.stdout, result.stderr, result.returncode)


def _clip(text: str) -> str:
    if len(text) <= SHOWN_CHARS:
        return text
    half = SHOWN_CHARS // 2
    return f"{text[:half]}\n...[{len(text) - SHOWN_CHARS} characters cut]...\n{text[-half:]}"


def _tail(text: str) -> str:
    """The end of a traceback: where the error is named."""
    text = text.strip()
    return text if len(text) <= SHOWN_CHARS else "..." + text[-SHOWN_CHARS:]
