"""Math: answer a question with one exact final answer.

Roles (Stronger-MAS), in turn order: `tool` writes Python that prints the answer (run in the
sandbox); `reasoner` reasons step by step and ends with `\\boxed{answer}`. Each sees the
other's latest answer: the reasoner the tool's program, output and answer of the same round,
the tool the reasoner's answer of the round before. The episode ends when both answers
verify as equal, or after `max_rounds`. Success: the reasoner's final answer is correct (checked
by math-verify against the task's answer). Single-agent mode: `reasoner` alone, which may
also run code; its episode ends when it gives the same answer twice in a row.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from pydantic import Field

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts
from masenvs.envs.tooling import ToolRun, run_tool
from masenvs.parsing import clip_text, last_code_block
from masenvs.tasks.loaders import TaskSource, open_source
from masenvs.tasks.math_judge import default_judge, last_boxed, printed_answer
from masenvs.tasks.records import MathTask


class MathConfig(EnvConfig):
    source: str = Field(
        "generated",
        description='Task source: "generated", "jsonl:/path/file.jsonl" or "hf:<dataset>" '
        "(aime2024, aime2025, math500, olympiadbench, gsm8k, dapo17k).",
    )
    split: str | None = Field(None, description="Dataset split (None: the dataset's default).")
    data_path: str | None = Field(
        None, description="A local copy of the hf: dataset (save_to_disk dir or data file)."
    )
    level: int = Field(2, ge=1, le=3, description="Difficulty of generated problems.")
    topics: tuple[str, ...] | None = Field(
        None, description="Topics of generated problems (None: all; see math_gen.TOPICS)."
    )
    max_rounds: int = Field(4, ge=1, le=1000, description="Rounds before the episode truncates.")
    correct_reward: float = Field(
        1.0, description="An agent's own reward for a correct answer; also the team reward."
    )
    format_penalty: float = Field(
        -1.0, description="For no \\boxed{} answer (reasoner) or no printed answer (tool)."
    )
    tool_timeout: float = Field(5.0, gt=0, description="Wall seconds for the tool's program.")
    verify_timeout: float = Field(5.0, gt=0, description="Seconds for one math-verify check.")
    shown_chars: int = Field(
        2000, ge=100, description="How much of the other agent's last answer is shown."
    )
    tool_task: Literal["program", "print"] = Field(
        "program",
        description="What the roles are asked for: 'program', a program that computes the "
        "answer and a step-by-step solution (the paper's roles); 'print', one `print(...)` line "
        "of the problem's expression and the reasoner's \\boxed{} answer at once (roles a "
        "135M model can play, see docs/learning.md).",
    )
    plain_text: bool = Field(
        False,
        description="Show the problem with its LaTeX math as plain text ('Compute $2 + 3 "
        "\\\\times 4$.' -> 'Compute 2 + 3 * 4.'), and the print role's example in the same "
        "form, so a small model can copy the expression into Python.",
    )
    answer_format: Literal["boxed", "number"] = Field(
        "boxed",
        description="How the reasoner gives its answer: 'boxed', in \\boxed{} (the paper's "
        "format); 'number', as a plain number, the last one in its answer (e.g. '14'), which "
        "a 135M model writes where it never closes a \\boxed{}. Either way the answer is "
        "judged against the task's.",
    )


# --- reward --------------------------------------------------------------------------------


def answer_reward(answer: str | None, correct: bool, cfg: MathConfig) -> float:
    """An agent's own outcome: right, wrong (0), or no answer at all (format penalty)."""
    if answer is None:
        return cfg.format_penalty
    return cfg.correct_reward if correct else 0.0


def team_reward(reasoner_correct: bool, cfg: MathConfig) -> float:
    """The team is judged by the reasoner's answer, the one it commits."""
    return cfg.correct_reward if reasoner_correct else 0.0


# --- prompts -------------------------------------------------------------------------------

SYSTEM = {
    "reasoner": (
        "You are the reasoning agent of a math team. Solve the problem step by step and end "
        "with your final answer in \\boxed{}, e.g. \\boxed{\\frac{3}{4}}. A tool agent solves "
        "the same problem by writing Python; its program, output and answer are shown when "
        "available. If your answers differ, find out which one is right."
    ),
    "tool": (
        "You are the tool agent of a math team. Write one Python program in a ```python block "
        "that computes the answer exactly (fractions.Fraction or sympy for exact values) and "
        "prints only the final answer on its last line, e.g. 3/4 or 42. It runs with no input "
        "and a time limit. The reasoning agent's solution is shown when available; if your "
        "answers differ, find out which one is right."
    ),
}
# tool_task "print": short roles for small models (one line of Python; the answer at once).
PRINT_SYSTEM = {
    "reasoner": (
        "You are the reasoning agent of a math team. The tool agent's Python program and its "
        "output are shown. Check them and give the final answer at once as \\boxed{answer}, "
        "e.g. \\boxed{14}."
    ),
    "tool": (
        "You are the tool agent of a math team. Write the problem as one line of Python that "
        "prints the answer, in a ```python block. For example, for 'Compute $2 + 3 \\times 4$.' "
        "answer:\n```python\nprint(2 + 3 * 4)\n```\nIt runs, and its output is shown to the "
        "reasoning agent."
    ),
}
PRINT_REMINDER = {
    "reasoner": "Answer with the final answer in \\boxed{}, for example: \\boxed{14}",
    "tool": "Answer with one line of Python, for example: print(2 + 3 * 4)",
}
PLAIN_TOOL_REMINDER = (
    "Answer with one line of Python that prints this problem's expression, as print(2 + 3 * 4) "
    "does for 'Compute 2 + 3 * 4.'"
)
# answer_format "number": the reasoner answers with a plain number.
NUMBER_SYSTEM = (
    "You are the reasoning agent of a math team. The tool agent's Python program and its "
    "output are shown. Check them and give the final answer at once as a plain number, e.g. 14."
)
NUMBER_REMINDER = "Answer with the final answer as a plain number only:"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def last_number(text: str) -> str | None:
    """The last number written in `text` ('14', '-3', '2.5', '3/4'), commas between digits
    dropped ('1,200' is 1200); None when there is none."""
    found = _NUMBER.findall(re.sub(r"(?<=\d),(?=\d{3}\b)", "", text))
    return found[-1] if found else None


SOLO_SYSTEM = (
    "You solve math problems. Reason step by step and end with your final answer in "
    "\\boxed{}, e.g. \\boxed{\\frac{3}{4}}. You may also write a Python program in a ```python "
    "block; it runs and you see its output next round. Your episode ends when you give the "
    "same answer twice in a row."
)


@dataclass
class MathState(EpisodeState):
    answers: dict[str, str | None] = field(default_factory=dict)  # latest, by agent
    correct: dict[str, bool] = field(default_factory=dict)  # latest answer correct, by agent
    agreed: bool = False
    tool_runs: list[ToolRun] = field(default_factory=list)


class MathEnv(MASEnv):
    name = "math"
    roles = ("tool", "reasoner")
    solo_role = "reasoner"
    config_class = MathConfig

    config: MathConfig
    task: MathTask
    state: MathState

    def __init__(self, config: MathConfig | None = None, render_mode: str | None = None, **kw: Any):
        super().__init__(config, render_mode, **kw)
        cfg = self.config
        self.source: TaskSource = open_source(
            cfg.source, "math", cfg.split, cfg.data_path, cfg.level, cfg.topics
        )

    def generate_task(self, rng: np.random.Generator) -> MathTask:
        return self.source.sample(rng)

    def load_task(self, task: Any) -> MathTask:
        return task if isinstance(task, MathTask) else MathTask.from_dict(task)

    def initial_state(self, task: MathTask) -> MathState:
        return MathState()

    def task_info(self) -> dict[str, Any]:
        return {"id": self.task.id, "source": self.task.source}

    def prompt(self, agent: str) -> list[Message]:
        cfg, state = self.config, self.state
        roles = PRINT_SYSTEM if cfg.tool_task == "print" else SYSTEM
        system = SOLO_SYSTEM if cfg.single_agent else roles[agent]
        if cfg.answer_format == "number" and (agent == "reasoner" or cfg.single_agent):
            system = NUMBER_SYSTEM if not cfg.single_agent else _solo_number(system)
        if cfg.plain_text and agent == "tool":  # its example in the problem's form
            system = plain_math(system)
        lines = [
            f"Problem:\n{plain_math(self.task.question) if cfg.plain_text else self.task.question}",
            "",
            f"Round {self.round + 1} of {cfg.max_rounds}.",
        ]
        if agent in state.answers:  # the agent has answered before
            own = state.answers[agent]
            lines.append(f"Your last answer: {own if own is not None else '(none found)'}")
            if (agent == "tool" or cfg.single_agent) and state.tool_runs:
                lines += _program_lines(state.tool_runs[-1], "Your program", cfg.shown_chars)
        other = "tool" if agent == "reasoner" else "reasoner"
        if not cfg.single_agent and other in state.answers:  # its latest, maybe this round's
            lines += ["", f"The {other} agent's latest answer:"]
            if other == "tool" and state.tool_runs:
                lines += _program_lines(state.tool_runs[-1], "Its program", cfg.shown_chars)
            else:
                lines.append(clip_text(self.last_actions.get(other, ""), cfg.shown_chars))
            answer = state.answers[other]
            lines.append(f"Its answer: {answer if answer is not None else '(none found)'}")
        feedback = self.last_feedback.get(agent)
        if feedback:
            lines += ["", feedback]
        if cfg.answer_format == "number" and (agent == "reasoner" or cfg.single_agent):
            shown = None if cfg.single_agent else state.answers.get("tool")
            lines += [  # the format, last, as plan-path does; the tool's answer as the example
                "",
                NUMBER_REMINDER
                if shown is None
                else f"{NUMBER_REMINDER[:-1]}, e.g. {shown} if the tool agent is right:",
            ]
        elif cfg.tool_task == "print" and not cfg.single_agent:
            plain = cfg.plain_text and agent == "tool"
            lines += ["", PLAIN_TOOL_REMINDER if plain else PRINT_REMINDER[agent]]
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n".join(lines)},
        ]

    # --- one round ----------------------------------------------------------------------------

    def play_turn(self, agent: str, action: str) -> RewardParts:
        if agent == "tool":
            return self._tool_turn(action)
        return self._reasoner_turn(action)

    def _tool_turn(self, action: str) -> RewardParts:
        cfg, state = self.config, self.state
        if cfg.tool_task == "print" and last_code_block(action) is None:
            action = _bare_print(action)  # one line of Python may come without a fence
        run = run_tool(action, cfg.tool_timeout, judged=True)
        state.tool_runs.append(run)
        answer = printed_answer(run.output) if run.ok else None
        correct = answer is not None and default_judge().equal(
            self.task.answer, answer, cfg.verify_timeout
        )
        state.answers["tool"], state.correct["tool"] = answer, correct
        self.last_feedback["tool"] = (
            ""
            if answer is not None
            else (run.describe(500) + "\nNo answer: print the final answer on the last line.")
        )
        return RewardParts(agent=answer_reward(answer, correct, cfg))

    def _reasoner_turn(self, text: str) -> RewardParts:
        """The reasoner's answer is the team's: it decides the team reward and the episode."""
        cfg, state, judge = self.config, self.state, default_judge()
        previous = state.answers.get("reasoner")
        if cfg.single_agent and last_code_block(text) is not None:
            state.tool_runs.append(run_tool(text, cfg.tool_timeout))
        answer = last_boxed(text) if cfg.answer_format == "boxed" else last_number(text)
        correct = answer is not None and judge.equal(self.task.answer, answer, cfg.verify_timeout)
        state.answers["reasoner"], state.correct["reasoner"] = answer, correct
        missing = (
            "No \\boxed{} answer found: end with \\boxed{answer}."
            if cfg.answer_format == "boxed"
            else "No number found: answer with a plain number."
        )
        self.last_feedback["reasoner"] = "" if answer is not None else missing
        # Multi-agent: the two roles agree; single-agent: the same answer twice in a row.
        other = previous if cfg.single_agent else state.answers.get("tool")
        state.agreed = judge.agree(answer, other, cfg.verify_timeout)
        if state.agreed:  # the team settled on an answer: the episode ends with its verdict
            state.success, state.failed = correct, not correct
        elif self.round + 1 >= cfg.max_rounds:
            state.success = correct
        return RewardParts(
            agent=answer_reward(answer, correct, cfg), team=team_reward(correct, cfg)
        )

    def answer_action(self, answer: str) -> str:
        """A bare answer ('14', '\\frac{3}{4}') is judged as itself: boxed unless it is."""
        kept = self.config.answer_format == "number" or last_boxed(answer) is not None
        if kept or not answer.strip():
            return answer
        return f"\\boxed{{{answer.strip()}}}"

    def _info(self, agent: str, parts: RewardParts | None) -> dict[str, Any]:
        info = super()._info(agent, parts)
        info["answers"] = dict(self.state.answers)
        info["correct"] = bool(self.state.correct.get("reasoner", False))
        return info

    def render_text(self) -> str:
        state = self.state
        answers = ", ".join(f"{a}={v}" for a, v in state.answers.items()) or "no answers yet"
        status = "solved" if state.success else "agreed" if state.agreed else f"round {self.round}"
        over = self.round > 0 and not self.agents  # the reference is shown once it cannot help
        reference = self.task.answer if over else "shown at the end"
        return f"math {self.task.id} ({status}): {answers}; reference {reference}"


_PLAIN = (
    ("\\times", "*"),
    ("\\cdot", "*"),
    ("\\div", "/"),
    ("\\left", ""),
    ("\\right", ""),
    ("$", ""),
)


def plain_math(text: str) -> str:
    """LaTeX math as plain text: '$35 + 6 \\times 10$' -> '35 + 6 * 10', '\\frac{a}{b}' ->
    '(a)/(b)', 'a^{2}' -> 'a**2'."""
    text = re.sub(r"\\d?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", text)
    text = re.sub(r"\^\{([^{}]*)\}", r"**\1", text)
    text = text.replace("^", "**")
    for latex, plain in _PLAIN:
        text = text.replace(latex, plain)
    return re.sub(r" {2,}", " ", text)


def _solo_number(system: str) -> str:
    return system.replace(
        "end with your final answer in \\boxed{}, e.g. \\boxed{\\frac{3}{4}}",
        "end with your final answer as a plain number, e.g. 14",
    )


def _bare_print(text: str) -> str:
    """The first `print(...)` call of `text` (to its closing parenthesis) as a python block."""
    at = text.find("print(")
    if at < 0:
        return text
    depth = 0
    for end in range(at + 5, len(text)):
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        if depth == 0:
            return f"```python\n{text[at : end + 1]}\n```"
    return f"```python\n{text[at:]}\n```"  # unclosed: runs, fails, and the tool sees why


def _program_lines(run: ToolRun, title: str, limit: int) -> list[str]:
    if run.verdict == "no_code":
        return [f"{title}: (no ```python block)"]
    return [
        f"{title}:",
        f"```python\n{clip_text(run.code.strip(), limit)}\n```",
        f"Output ({run.verdict}):",
        clip_text(run.output, limit // 2) or "(no output)",
    ]
