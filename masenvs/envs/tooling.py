"""The `tool` role: run the last Python block of an answer in the sandbox."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from masenvs.parsing import clip_text, last_code_block
from masenvs.sandbox import default_sandbox

log = logging.getLogger(__name__)


@dataclass
class ToolRun:
    """A tool agent's program and what it printed."""

    code: str
    output: str
    verdict: str  # a sandbox verdict, or "no_code" when the answer held no code block

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"

    def describe(self, limit: int = 1500) -> str:
        if self.verdict == "no_code":
            return "No ```python block found in your answer."
        head = "Your program ran." if self.ok else f"Your program failed ({self.verdict})."
        return f"{head} Output:\n{clip_text(self.output, limit) or '(no output)'}"


def run_tool(answer: str, timeout: float, stdin: str = "", judged: bool = False) -> ToolRun:
    """Run the last code block of `answer`; stdout on success, stdout and stderr otherwise.

    `judged`: what it prints is rewarded, so a sandbox that cannot hide the task's data (a
    dataset's answers) refuses to run it (SandboxError, see Sandbox.check_judging)."""
    code = last_code_block(answer)
    if code is None:
        return ToolRun(code="", output="", verdict="no_code")
    sandbox = default_sandbox()
    if judged:
        sandbox.check_judging("judge a tool program's printed answer")
    limits = dataclasses.replace(sandbox.limits, wall_seconds=timeout, cpu_seconds=timeout)
    try:
        result = sandbox.run(code, stdin=stdin, limits=limits)
    except OSError as exc:  # the sandbox itself failed: the agent is not to blame, say so
        log.error("sandbox failed to run a tool program: %s", exc)
        return ToolRun(code=code, output=f"sandbox failure: {exc}", verdict="sandbox_error")
    output = result.stdout if result.ok else (result.stdout + "\n" + result.stderr).strip()
    return ToolRun(
        code=code, output=output, verdict=getattr(result.verdict, "value", str(result.verdict))
    )


def round_context(
    agent: str, feedback: str | None, runs: list[ToolRun], show_tool: bool
) -> list[str]:
    """Prompt lines after the board: last round's feedback and, for `plan` in multi-agent
    mode, the tool agent's latest program and its output."""
    lines: list[str] = []
    if feedback:
        lines += ["", "Last round:", feedback]
    if agent == "plan" and show_tool and runs:
        run = runs[-1]
        lines += ["", "The tool agent's program:", f"```python\n{clip_text(run.code, 3000)}\n```"]
        lines += ["Its output:", clip_text(run.output, 2000) or "(no output)"]
    return lines
