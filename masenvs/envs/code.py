"""Code: write a program that passes hidden tests.

Roles (Stronger-MAS), in turn order: `coder` writes the solution; `tester` then sees that
program and writes test cases (input and expected output). The coder sees, next round, where
its program disagrees with the tester's tests and the public examples (input, expected,
actual) and decides which side is wrong. Hidden tests
decide the coder's reward (pass rate) and the team's success (all pass, which ends the
episode). The tester is rewarded for tests that agree with a correct program (see
`tester_reward`). Single-agent mode: `coder` alone, with the public examples as feedback.
Tasks are stdin/stdout programs or call-based functions (`CodeTask.fn_name`).
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import Field

from masenvs.env import EnvConfig, EpisodeState, MASEnv, Message, RewardParts
from masenvs.parsing import clip_text, last_code_block
from masenvs.tasks.code_judge import CodeJudge, Suite, SuiteResult
from masenvs.tasks.loaders import TaskSource, open_source
from masenvs.tasks.records import CodeTask, TestCase


class CodeConfig(EnvConfig):
    source: str = Field(
        "builtin",
        description='Task source: "builtin", "jsonl:/path/file.jsonl" or "hf:<dataset>" '
        "(apps, code_contests, livecodebench).",
    )
    split: str | None = Field(None, description="Dataset split (None: the dataset's default).")
    data_path: str | None = Field(
        None, description="A local copy of the hf: dataset (save_to_disk dir or data file)."
    )
    max_rounds: int = Field(4, ge=1, le=1000, description="Rounds before the episode truncates.")
    test_timeout: float = Field(
        5.0, gt=0, description="CPU seconds per test case (wall-clock backstop: 2x + 1 s)."
    )
    stop_at_first_failure: bool = Field(
        False,
        description="Stop grading a program at its first failed test (the rest count as failed).",
    )
    max_hidden_tests: int | None = Field(
        None, ge=1, description="Grade on the first N hidden tests only (faster training)."
    )
    max_tester_tests: int = Field(8, ge=1, le=100, description="Tester test cases kept per round.")
    shown_failures: int = Field(3, ge=1, description="Failed cases shown to an agent per round.")
    pass_reward: float = Field(1.0, description="Coder's own reward: times its hidden pass rate.")
    team_reward: float = Field(1.0, description="Both agents: times the team program's pass rate.")
    validity_reward: float = Field(
        1.0,
        description="Tester's own reward: times the share of its tests a correct program passes.",
    )
    format_penalty: float = Field(
        -1.0, description="For no ```python block (coder) or no readable test case (tester)."
    )
    shown_chars: int = Field(3000, ge=200, description="How much of a program is shown back.")


# --- reward --------------------------------------------------------------------------------


def coder_reward(pass_rate: float | None, cfg: CodeConfig) -> float:
    """The coder's own outcome: its hidden-test pass rate, or the penalty for no code."""
    return cfg.format_penalty if pass_rate is None else cfg.pass_reward * pass_rate


def tester_reward(n_tests: int, validity: float | None, cfg: CodeConfig) -> float:
    """The tester's own outcome: the share of its tests that a correct program passes.

    The correct program is the task's reference solution, else a coder program that passed
    every hidden test; with neither (validity None) the tester earns only the team share.
    """
    if n_tests == 0:
        return cfg.format_penalty
    return 0.0 if validity is None else cfg.validity_reward * validity


def team_outcome(pass_rate: float, cfg: CodeConfig) -> float:
    """Shared by both agents: how well the team's current program does on the hidden tests."""
    return cfg.team_reward * pass_rate


# --- parsing -------------------------------------------------------------------------------

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)


def _value(text: str) -> Any:
    """A JSON value, or a Python literal (True, None, tuples) as its JSON equivalent."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        if len(text) > 100_000:
            raise
    return json.loads(json.dumps(ast.literal_eval(text)))


def parse_tests(text: str, call_based: bool, limit: int) -> tuple[list[TestCase], int]:
    """Test cases from fenced blocks labelled "input" then "output"; and how many were unreadable.

    Call-based inputs must be a JSON list of arguments; outputs any JSON value.
    """
    blocks: list[tuple[str | None, str]] = []
    end = 0
    for match in _FENCE.finditer(text):  # linear: fences never overlap
        label = text[end : match.start()][-200:].lower()
        i, o = label.rfind("input"), label.rfind("output")
        blocks.append(("output" if o > i else "input" if i > o else None, match.group(1)))
        end = match.end()
    tests: list[TestCase] = []
    unreadable = 0
    for (kind, body), (next_kind, next_body) in zip(blocks, blocks[1:]):
        if kind != "input" or next_kind != "output":
            continue
        if len(tests) + unreadable >= limit:
            break
        if not call_based:
            tests.append(TestCase(body, next_body))
            continue
        try:
            args, expected = _value(body), _value(next_body)
        except (ValueError, SyntaxError, TypeError, RecursionError, MemoryError):
            unreadable += 1
            continue
        if isinstance(args, list):
            tests.append(TestCase(args, expected))
        else:
            unreadable += 1
    return tests, unreadable


# --- prompts -------------------------------------------------------------------------------

_TEST_FORMAT = {
    False: (
        "Write each test case as\n**Test Input:**\n```\n<the exact stdin>\n```\n"
        "**Test Output:**\n```\n<the exact expected stdout>\n```"
    ),
    True: (
        "Write each test case as\n**Test Input:**\n```json\n<a JSON list of the arguments, e.g. "
        "[[1, 2, 3], 2] for f([1, 2, 3], 2)>\n```\n**Test Output:**\n```json\n<the JSON of the "
        "expected return value>\n```"
    ),
}


def io_rules(task: CodeTask) -> str:
    if task.fn_name is None:
        return "The program reads standard input and writes its answer to standard output."
    return (
        f"Define the function `{task.fn_name}` (or, when the starter code shows one, a class "
        "`Solution` with that method). Each test calls it with the test's arguments and "
        "compares its return value; nothing is read from standard input."
    )


SYSTEM = {
    "coder": (
        "You are the coding agent of a programming team. Write a complete, efficient Python 3 "
        "solution in one ```python block. A tester agent writes test cases; when your program "
        "disagrees with them you see the input, the expected output and yours. The tester can "
        "be wrong too: decide whether your program or the test is wrong, then fix your program."
    ),
    "tester": (
        "You are the testing agent of a programming team. Write test cases that a correct "
        "solution passes and that expose mistakes (edge cases, tricky inputs). Work out each "
        "expected output carefully: a test with a wrong expected output misleads the coder. "
        "The coder's program and how it did on your tests are shown when available."
    ),
}
SOLO_SYSTEM = (
    "You solve programming problems. Write a complete, efficient Python 3 solution in one "
    "```python block. You see how it does on the examples and can fix it next round."
)


@dataclass
class CodeState(EpisodeState):
    code: str | None = None  # the team's current program (the coder's latest)
    tests: tuple[TestCase, ...] = ()  # the tester's latest readable tests
    pass_rate: float = 0.0  # of `code` on the hidden tests
    verified_code: str | None = None  # a program that passed every hidden test
    validity: float | None = None  # share of the tester's tests a correct program passes


class CodeEnv(MASEnv):
    name = "code"
    roles = ("coder", "tester")
    solo_role = "coder"
    config_class = CodeConfig

    config: CodeConfig
    task: CodeTask
    state: CodeState

    def __init__(self, config: CodeConfig | None = None, render_mode: str | None = None, **kw: Any):
        super().__init__(config, render_mode, **kw)
        cfg = self.config
        self.source: TaskSource = open_source(cfg.source, "code", cfg.split, cfg.data_path)
        self.judge = CodeJudge(
            timeout=cfg.test_timeout, stop_at_first_failure=cfg.stop_at_first_failure
        )

    def generate_task(self, rng: np.random.Generator) -> CodeTask:
        return self.source.sample(rng)

    def load_task(self, task: Any) -> CodeTask:
        return task if isinstance(task, CodeTask) else CodeTask.from_dict(task)

    def initial_state(self, task: CodeTask) -> CodeState:
        return CodeState()

    def answer_action(self, answer: str) -> str:
        """A bare program is the program: fenced unless it is."""
        bare = answer.strip() and "```" not in answer
        return f"```\n{answer.strip()}\n```" if bare else answer

    def task_info(self) -> dict[str, Any]:
        return {
            "id": self.task.id,
            "source": self.task.source,
            "call_based": self.task.call_based,
            "hidden_tests": len(self.hidden_tests()),
        }

    def hidden_tests(self) -> tuple[TestCase, ...]:
        n = self.config.max_hidden_tests
        return self.task.tests[:n] if n else self.task.tests

    def prompt(self, agent: str) -> list[Message]:
        cfg, task, state = self.config, self.task, self.state
        system = SOLO_SYSTEM if cfg.single_agent else SYSTEM[agent]
        lines = [f"Problem:\n{task.prompt}", "", io_rules(task)]
        if task.starter_code.strip():
            lines += ["Starter code:", f"```python\n{task.starter_code.rstrip()}\n```"]
        if task.public_tests:
            lines.append("Examples:")
            lines += [_show_test(t, task.call_based) for t in task.public_tests[:3]]
        if agent == "tester":
            lines += [
                "",
                f"Give up to {cfg.max_tester_tests} test cases. " + _TEST_FORMAT[task.call_based],
            ]
        lines += ["", f"Round {self.round + 1} of {cfg.max_rounds}."]
        if agent == "coder" and state.code is not None:
            lines += [
                "Your last program:",
                f"```python\n{clip_text(state.code.strip(), cfg.shown_chars)}\n```",
            ]
        if agent == "tester":
            if self.round > 0:
                lines.append(f"Your last tests: {len(state.tests)} readable.")
            if state.code is not None:  # the coder's latest, this round's when it has acted
                lines += [
                    "The coder's latest program:",
                    f"```python\n{clip_text(state.code.strip(), cfg.shown_chars)}\n```",
                ]
        feedback = self.last_feedback.get(agent)
        if feedback:
            lines += ["", feedback]
        return [
            {"role": "system", "content": system},
            {"role": "user", "content": "\n".join(lines)},
        ]

    # --- one round ----------------------------------------------------------------------------

    def play_turn(self, agent: str, action: str) -> RewardParts:
        if agent == "coder":
            return self._coder_turn(action)
        return self._tester_turn(action)

    def _coder_turn(self, action: str) -> RewardParts:
        """The coder's program is the team's: hidden tests decide its reward and the team's."""
        cfg, task, state = self.config, self.task, self.state
        code = last_code_block(action)
        visible = [*state.tests, *task.public_tests]
        on_visible: SuiteResult | None = None
        if code is not None:
            # Visible tests first, hidden after, never at once: a run on hidden inputs could
            # otherwise signal them (CPU or memory pressure) to a concurrent run whose output
            # the coder reads next round (docs/sandbox.md, covert channels).
            if visible:
                on_visible = self.judge.run(code, visible, task.fn_name)
            hidden = self.judge.run(code, self.hidden_tests(), task.fn_name)
            state.code, state.pass_rate = code, hidden.pass_rate
            if hidden.all_passed:
                state.verified_code = code
            if cfg.single_agent:  # with a tester, the round ends at its turn (see below)
                state.success = hidden.all_passed
        self.last_feedback["coder"] = self._coder_feedback(code, on_visible, visible)
        return RewardParts(
            agent=coder_reward(state.pass_rate if code is not None else None, cfg),
            team=team_outcome(state.pass_rate, cfg),
        )

    def _tester_turn(self, action: str) -> RewardParts:
        """The tester's tests are checked against a known-correct program (validity) and run
        on the coder's program, whose failures the coder sees next round."""
        cfg, task, state = self.config, self.task, self.state
        fn = task.fn_name
        new_tests, unreadable = parse_tests(action, task.call_based, cfg.max_tester_tests)
        if new_tests:
            state.tests = tuple(new_tests)
        visible = [*state.tests, *task.public_tests]
        oracle = task.reference_solution or state.verified_code
        suites: dict[str, Suite] = {}
        if new_tests and oracle is not None:  # the judge runs it apart, on data only
            suites["validity"] = Suite(oracle, tuple(new_tests), fn, oracle=True)
        if new_tests and state.code is not None:
            suites["visible"] = Suite(state.code, tuple(visible), fn)
        results = dict(zip(suites, self.judge.run_many(list(suites.values()))))
        validity = results["validity"].pass_rate if "validity" in results else None
        state.validity = validity if new_tests else None
        if "visible" in results:  # the coder's next prompt shows where the new tests disagree
            self.last_feedback["coder"] = self._coder_feedback(
                state.code, results["visible"], visible
            )
        self.last_feedback["tester"] = self._tester_feedback(
            new_tests, unreadable, results.get("visible"), results.get("validity")
        )
        # The episode ends after the round in which the team's program passed every hidden
        # test, so the tester still gets its turn, checked against that verified program.
        state.success = state.code is not None and state.pass_rate == 1.0
        return RewardParts(agent=tester_reward(len(new_tests), validity, cfg))

    def _coder_feedback(
        self, code: str | None, result: SuiteResult | None, visible: list[TestCase]
    ) -> str:
        if code is None:
            return "No ```python block found: put your whole program in one."
        if result is None:
            return "Your program ran; there were no tests to show it on yet."
        failed = result.failures()
        if not failed:
            return f"Your program passed all {len(visible)} visible tests."
        n_tester = len(self.state.tests)
        lines = [f"Your program failed {len(failed)} of {len(visible)} visible tests:"]
        for i in failed[: self.config.shown_failures]:
            origin = "the tester's test" if i < n_tester else "an example"
            lines.append(
                f"- {origin}:\n{result.cases[i].describe(visible[i], self.task.call_based)}"
            )
        return "\n".join(lines)

    def _tester_feedback(
        self,
        tests: list[TestCase],
        unreadable: int,
        on_code: SuiteResult | None,
        validity: SuiteResult | None,
    ) -> str:
        if not tests:
            return "No readable test case found. " + _TEST_FORMAT[self.task.call_based]
        lines = [
            f"{len(tests)} test(s) read" + (f", {unreadable} unreadable." if unreadable else ".")
        ]
        if validity is None:
            lines.append("No known-correct program yet to check your expected outputs.")
        else:
            wrong = [i + 1 for i in validity.failures()]
            lines.append(
                f"{validity.n_passed} of {len(tests)} agree with a correct program"
                + (f"; tests {wrong} have a wrong expected output." if wrong else ".")
            )
        if on_code is not None:
            failed = [i for i in on_code.failures() if i < len(tests)]
            lines.append(f"The coder's program fails {len(failed)} of your tests.")
            for i in failed[: self.config.shown_failures]:
                lines.append(
                    f"- test {i + 1}:\n{on_code.cases[i].describe(tests[i], self.task.call_based)}"
                )
        return "\n".join(lines)

    def _info(self, agent: str, parts: RewardParts | None) -> dict[str, Any]:
        info = super()._info(agent, parts)
        info["pass_rate"] = self.state.pass_rate
        info["tester_validity"] = self.state.validity
        return info

    def render_text(self) -> str:
        s = self.state
        status = "solved" if s.success else f"round {self.round}"
        validity = "n/a" if s.validity is None else f"{s.validity:.2f}"
        return (
            f"code {self.task.id} ({status}): hidden pass rate {s.pass_rate:.2f}, "
            f"{len(s.tests)} tester tests, validity {validity}"
        )


def _show_test(test: TestCase, call_based: bool) -> str:
    def show(value: Any) -> str:
        return json.dumps(value) if call_based else str(value).rstrip()

    return f"Input:\n```\n{show(test.input)}\n```\nOutput:\n```\n{show(test.output)}\n```"
