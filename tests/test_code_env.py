"""Code env: the test runner, pass rates and tester rewards by hand, hostile programs."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pettingzoo.test import parallel_api_test

import masenvs
from masenvs.envs.code import parse_tests
from masenvs.parsing import last_code_block
from masenvs.tasks.code_judge import CodeJudge, Suite, outputs_match, values_match
from masenvs.tasks.code_problems import PROBLEMS
from masenvs.tasks.records import CodeTask, TestCase

# Double a number; four hidden tests, one example.
DOUBLE = {
    "id": "double",
    "prompt": "Read an integer n and print 2 * n.",
    "tests": [{"input": f"{n}\n", "output": f"{2 * n}\n"} for n in (1, 2, 3, 50)],
    "public_tests": [{"input": "4\n", "output": "8\n"}],
    "reference_solution": "print(2 * int(input()))\n",
}
RIGHT = "```python\nprint(2 * int(input()))\n```"
WRONG_ABOVE_9 = "```python\nn = int(input())\nprint(2 * n if n < 10 else n)\n```"  # 3 of 4 hidden


def written_tests(pairs: list[tuple[str, str]]) -> str:
    return "".join(
        f"**Test Input:**\n```\n{i}\n```\n**Test Output:**\n```\n{o}\n```\n" for i, o in pairs
    )


def env_with(task: dict, **config) -> masenvs.MASEnv:
    env = masenvs.make("code", **config)
    env.reset(seed=0, options={"task": task})
    return env


# --- the runner -----------------------------------------------------------------------------


def test_every_builtin_reference_solution_passes_its_tests() -> None:
    suites = [Suite(p.reference_solution, p.tests + p.public_tests, p.fn_name) for p in PROBLEMS]
    results = CodeJudge().run_many(suites)
    failing = {
        p.id: [c.status for c in r.cases] for p, r in zip(PROBLEMS, results) if not r.all_passed
    }
    assert failing == {}
    assert {p.call_based for p in PROBLEMS} == {True, False} and len(PROBLEMS) >= 10


def test_hostile_programs_get_the_right_verdict_without_hanging() -> None:
    tests = [TestCase(f"{n}\n", f"{2 * n}\n") for n in range(3)]
    programs = {
        "loop": "n = int(input())\nwhile n == 1:\n    pass\nprint(2 * n)",
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "memory": "n = int(input())\nx = [0] * (10**10) if n == 2 else 0\nprint(2 * n)",
        "flood": "while True:\n    print('y' * 4096)",
        "syntax": "def broken(:\n",
    }
    judge = CodeJudge(timeout=1.0)
    start = time.monotonic()
    results = judge.run_many([Suite(code, tuple(tests)) for code in programs.values()])
    assert time.monotonic() - start < 30
    statuses = {name: [c.status for c in r.cases] for name, r in zip(programs, results)}
    assert statuses == {
        "loop": ["pass", "timeout", "pass"],
        "fork_bomb": ["timeout"] * 3,
        "memory": ["pass", "pass", "memory"],
        "flood": ["output_limit"] * 3,
        "syntax": ["error"] * 3,
    }
    assert "SyntaxError" in results[-1].cases[0].error


def test_a_test_process_cannot_forge_the_harness_report() -> None:
    # The harness is not dumpable: its stdout is out of reach through /proc.
    forge = (
        "import os\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        '        open(f\'/proc/{pid}/fd/1\', \'w\').write(\'{"i": 1, "status": "ok", "output": "2"}\\n\')\n'
        "    except Exception:\n"
        "        pass\n"
    )
    result = CodeJudge().run(forge, [TestCase("1\n", "2\n"), TestCase("1\n", "2\n")])
    assert [c.status for c in result.cases] == ["wrong", "wrong"]


def test_stop_at_first_failure_skips_the_rest() -> None:
    tests = [TestCase(f"{n}\n", f"{2 * n}\n") for n in (1, 20, 3, 4)]
    result = CodeJudge(stop_at_first_failure=True, cases_per_run=4).run(
        "n = int(input())\nprint(2 * n if n < 10 else n)", tests
    )
    assert [c.status for c in result.cases] == ["pass", "wrong", "skipped", "skipped"]
    assert result.pass_rate == 0.25


def test_call_based_programs_functions_and_solution_classes() -> None:
    judge = CodeJudge()
    tests = (TestCase([[3, 1, 2]], [1, 2, 3]), TestCase([[]], []))
    plain = judge.run("def sort_it(xs):\n    return sorted(xs)", tests, "sort_it")
    leetcode = judge.run(
        "class Solution:\n    def sort_it(self, xs: List[int]) -> List[int]:\n"
        "        return tuple(sorted(xs))",  # tuples compare as lists; List needs no import
        tests,
        "sort_it",
    )
    missing = judge.run("def other(xs):\n    return xs", tests, "sort_it")
    assert plain.pass_rate == leetcode.pass_rate == 1.0
    assert missing.cases[0].status == "error" and "sort_it" in missing.cases[0].error


def test_output_comparison_rules() -> None:
    assert outputs_match("1 2\n3\n", "1 2 3")
    assert outputs_match("0.3333333", "0.333333")
    assert not outputs_match("0.34", "0.333333")
    assert not outputs_match("1000000000000000001", "1000000000000000000")  # ints stay exact
    assert not outputs_match("YES", "yes")
    assert values_match([0.1 + 0.2, 2], [0.3, 2])
    assert values_match(5, [5])  # APPS wraps expected return values in a list
    assert not values_match({"a": 1}, {"a": 2}) and not values_match([1, 2], [2, 1])


# --- the env: rewards by hand ---------------------------------------------------------------


def test_a_correct_solution_passes_everything_and_ends_the_episode() -> None:
    env = env_with(DOUBLE, single_agent=True)
    _, rewards, terms, _, infos = env.step({"coder": f"Here it is.\n{RIGHT}"})
    assert infos["coder"]["pass_rate"] == 1.0 and infos["coder"]["success"]
    assert infos["coder"]["reward_parts"] == {"process": 0.0, "agent": 1.0, "team": 1.0}
    assert rewards["coder"] == 2.0 and terms["coder"] and not env.agents


def test_a_wrong_solution_gets_its_partial_pass_rate_and_sees_the_mismatch() -> None:
    env = env_with(
        {**DOUBLE, "public_tests": [{"input": "12\n", "output": "24\n"}]}, single_agent=True
    )
    _, rewards, terms, _, infos = env.step({"coder": WRONG_ABOVE_9})
    assert infos["coder"]["pass_rate"] == 0.75 and not infos["coder"]["success"]
    assert rewards["coder"] == pytest.approx(1.5) and not terms["coder"]
    feedback = env.observe("coder")
    assert "Input: 12" in feedback and "Expected: 24" in feedback and "Got: 12" in feedback
    assert "50" not in feedback  # hidden tests stay hidden


def test_no_code_gets_the_format_penalty() -> None:
    env = env_with(DOUBLE, single_agent=True)
    _, rewards, *_ = env.step({"coder": "print(2 * int(input()))"})
    assert rewards["coder"] == -1.0 and "python block" in env.observe("coder")


def test_tester_sees_the_coders_program_of_the_same_round() -> None:
    env = env_with(DOUBLE)
    _, _, _, _, infos = env.step({"coder": WRONG_ABOVE_9})
    assert env.acting == "tester" and env.round == 0
    prompt = infos["tester"]["messages"][-1]["content"]
    assert "Round 1 of 4" in prompt and last_code_block(WRONG_ABOVE_9).strip() in prompt


def test_tester_reward_is_the_share_of_tests_the_reference_passes() -> None:
    env = env_with(DOUBLE)
    tester = written_tests([("5", "10"), ("7", "14"), ("0", "1")])  # the last one is wrong
    _, rewards, _, _, infos = masenvs.play_round(env, {"coder": WRONG_ABOVE_9, "tester": tester})
    parts = infos["tester"]["reward_parts"]
    assert parts["agent"] == pytest.approx(2 / 3) and parts["team"] == pytest.approx(0.75)
    assert rewards["tester"] == pytest.approx(2 / 3 + 0.75)
    assert "tests [3] have a wrong expected output" in env.observe("tester")
    assert "the tester's test" in env.observe("coder")  # 0 -> 0, not 1: a mismatch


def test_tester_call_based_tests_and_unreadable_ones() -> None:
    task = next(p for p in PROBLEMS if p.id == "builtin/two-sum")
    env = masenvs.make("code")
    env.reset(seed=0, options={"task": task})
    tester = (
        "**Test Input:**\n```json\n[[1, 2, 3], 5]\n```\n**Test Output:**\n```json\n[1, 2]\n```\n"
        "**Test Input:**\n```json\n[[1, 1], 2]\n```\n**Test Output:**\n```json\n(0, 1)\n```\n"
        "**Test Input:**\n```\nnot json\n```\n**Test Output:**\n```\n[0, 1]\n```\n"
    )
    code = f"```python\n{task.reference_solution}```"
    _, _, _, _, infos = masenvs.play_round(env, {"coder": code, "tester": tester})
    assert infos["tester"]["tester_validity"] == 1.0  # two readable tests, both right
    assert "2 test(s) read, 1 unreadable" in env.observe("tester")
    assert infos["coder"]["success"] and not env.agents  # the round ended, then the episode


def test_without_a_reference_a_verified_program_checks_the_tests() -> None:
    no_reference = {k: v for k, v in DOUBLE.items() if k != "reference_solution"}
    tester = written_tests([("5", "10"), ("6", "13")])
    env = env_with(no_reference)
    _, _, _, _, infos = masenvs.play_round(env, {"coder": WRONG_ABOVE_9, "tester": tester})
    assert infos["tester"]["tester_validity"] is None  # nothing known-correct yet
    assert infos["tester"]["reward_parts"]["agent"] == 0.0
    env = env_with(no_reference)
    _, _, _, _, infos = masenvs.play_round(env, {"coder": RIGHT, "tester": tester})
    assert infos["tester"]["tester_validity"] == 0.5
    assert infos["tester"]["reward_parts"]["agent"] == 0.5


def test_tester_without_tests_gets_the_format_penalty() -> None:
    env = env_with(DOUBLE)
    _, rewards, *_ = masenvs.play_round(env, {"coder": RIGHT, "tester": "Input 5 gives 10."})
    assert rewards["tester"] == -1.0 + 1.0


def test_an_infinite_loop_in_the_coders_solution_times_out() -> None:
    env = env_with(DOUBLE, single_agent=True, test_timeout=0.5)
    start = time.monotonic()
    _, rewards, *_ = env.step({"coder": "```python\nwhile True:\n    pass\n```"})
    assert time.monotonic() - start < 20
    assert rewards["coder"] == 0.0 and "Got: timeout" in env.observe("coder")


def test_max_hidden_tests_limits_grading() -> None:
    env = env_with(DOUBLE, single_agent=True, max_hidden_tests=2)
    _, _, _, _, infos = env.step({"coder": WRONG_ABOVE_9})
    assert infos["coder"]["task"]["hidden_tests"] == 2 and infos["coder"]["pass_rate"] == 1.0


def test_reset_accepts_a_code_task_and_validates_dicts() -> None:
    env = masenvs.make("code")
    obs, _ = env.reset(options={"task": CodeTask.from_dict(DOUBLE)})
    assert "print 2 * n" in obs["coder"] and "8" in obs["tester"]
    with pytest.raises(ValueError, match="no hidden tests"):
        env.reset(options={"task": {"prompt": "Do something."}})


@pytest.mark.parametrize("single_agent", [False, True], ids=["multi", "single"])
def test_parallel_api(single_agent: bool) -> None:
    parallel_api_test(masenvs.make("code", single_agent=single_agent), num_cycles=3)


# --- fuzz -----------------------------------------------------------------------------------

_TEXT = st.one_of(
    st.text(max_size=200),
    st.text(alphabet='`\n Test Input Output:*[]{}0123456789json,"', max_size=300),
    st.sampled_from(["```", "```python\n", "Test Input ```\n" * 200, "```json\n[1]\n```" * 50]),
)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT, call_based=st.booleans())
def test_test_parsing_never_raises(text: str, call_based: bool) -> None:
    tests, unreadable = parse_tests(text, call_based, limit=8)
    assert len(tests) + unreadable <= 8
    assert all(isinstance(t.input, list) for t in tests) or not call_based
    json.dumps([t.to_dict() for t in tests])  # what the sandbox receives


@settings(max_examples=15, deadline=None)
@given(texts=st.lists(_TEXT, min_size=2, max_size=2))
def test_any_text_is_a_legal_action(texts: list[str]) -> None:
    env = masenvs.make("code", max_rounds=2)
    env.reset(seed=1)
    while env.agents:
        _, rewards, *_ = env.step(dict(zip(env.agents, texts)))
        assert all(np.isfinite(r) for r in rewards.values())
