"""Math env: answer checking, rewards by hand, the two-role round, hostile programs."""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pettingzoo.test import parallel_api_test

import masenvs
from masenvs.tasks.math_gen import TOPICS, generate_math_task
from masenvs.tasks.math_judge import MathJudge, default_judge, last_boxed, printed_answer
from masenvs.tasks.records import MathTask

HALF = {"id": "half", "question": "What is one half as a number?", "answer": "\\frac{1}{2}"}


def solo(**config) -> masenvs.MASEnv:
    env = masenvs.make("math", single_agent=True, **config)
    env.reset(seed=0, options={"task": HALF})
    return env


def tool_program(printed: str) -> str:
    return f"I compute it.\n```python\nprint({printed!r})\n```"


# --- answer checking ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pred",
    ["\\frac{1}{2}", "0.5", "1/2", "\\dfrac{1}{2}", "$\\frac{2}{4}$", "\\boxed{0.50}", ".5"],
)
def test_equivalent_forms_of_one_half_are_correct(pred: str) -> None:
    assert default_judge().equal("\\frac{1}{2}", pred)


@pytest.mark.parametrize("pred", ["\\frac{1}{3}", "2", "0.49", "-\\frac{1}{2}", "x", "", None])
def test_other_values_are_wrong(pred: str | None) -> None:
    assert not default_judge().equal("\\frac{1}{2}", pred)


def test_symbolic_answers_go_through_math_verify() -> None:
    judge = default_judge()
    assert judge.equal("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})")
    assert judge.equal("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2")
    assert judge.equal("5000", "5,000")
    assert not judge.equal("\\frac{\\sqrt{2}}{2}", "\\sqrt{3}/2")


def test_a_pathological_answer_is_cut_off_not_hung() -> None:
    judge = MathJudge(timeout=1.0)
    judge.equal("\\sqrt{2}", "\\sqrt{2}+0")  # start the worker outside the timed part
    start = time.monotonic()
    assert not judge.equal("42", "9^{9^{9^{9}}}")  # sympy would evaluate this forever
    assert time.monotonic() - start < 10
    assert judge.timeouts == 1
    assert judge.equal("\\frac{1}{3}", "0.333333")  # a fresh worker takes over
    judge.close()


def test_judging_works_off_the_main_thread() -> None:
    # math-verify's own timeout uses SIGALRM and fails on other threads; ours does not.
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: default_judge().equal("\\sqrt{2}", p), ["\\sqrt 2"] * 8))
    assert results == [True] * 8


def test_boxed_and_printed_answer_extraction() -> None:
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{a}{b^{2}}}.") == "\\frac{a}{b^{2}}"
    assert last_boxed("\\boxed{3} and a broken \\boxed{") == "3"
    assert last_boxed("no answer") is None and last_boxed("\\boxed{}") is None
    assert printed_answer("step 1\nstep 2\n  7/3  \n\n") == "7/3"
    assert printed_answer("the result is \\boxed{12}\ndone") == "12"
    assert printed_answer("   \n") is None


# --- rewards by hand ------------------------------------------------------------------------


@pytest.mark.parametrize("answer", ["\\frac{1}{2}", "0.5", "1/2"])
def test_correct_answer_rewards_reasoner_and_team(answer: str) -> None:
    env = solo()
    _, rewards, _, _, infos = env.step({"reasoner": f"So it is \\boxed{{{answer}}}."})
    assert infos["reasoner"]["reward_parts"] == {"process": 0.0, "agent": 1.0, "team": 1.0}
    assert rewards["reasoner"] == 2.0 and infos["reasoner"]["correct"]


def test_wrong_answer_and_no_answer() -> None:
    env = solo()
    _, rewards, _, _, infos = env.step({"reasoner": "It is \\boxed{2}."})
    assert infos["reasoner"]["reward_parts"] == {"process": 0.0, "agent": 0.0, "team": 0.0}
    _, rewards, _, _, infos = env.step({"reasoner": "It is one half, I think."})
    assert infos["reasoner"]["reward_parts"]["agent"] == -1.0 and rewards["reasoner"] == -1.0
    assert "boxed" in env.observe("reasoner")


def test_reward_values_come_from_the_config() -> None:
    env = solo(correct_reward=3.0, format_penalty=-0.5, reward_weights={"team": 0.0})
    _, rewards, *_ = env.step({"reasoner": "\\boxed{0.5}"})
    assert rewards["reasoner"] == 3.0
    env = solo(correct_reward=3.0, format_penalty=-0.5)
    _, rewards, *_ = env.step({"reasoner": "no box"})
    assert rewards["reasoner"] == -0.5


def test_solo_episode_ends_when_the_answer_repeats() -> None:
    env = solo()
    _, _, terms, _, _ = env.step({"reasoner": "\\boxed{0.5}"})
    assert not terms["reasoner"] and env.agents
    _, _, terms, _, infos = env.step({"reasoner": "Still \\boxed{1/2}"})
    assert terms["reasoner"] and infos["reasoner"]["success"] and not env.agents


def test_solo_reasoner_can_run_code_and_sees_its_output() -> None:
    env = solo()
    env.step({"reasoner": "```python\nprint(2**20)\n```\nanswer \\boxed{0.5}"})
    assert "1048576" in env.observe("reasoner")


# --- two roles ------------------------------------------------------------------------------


def duo(**config) -> masenvs.MASEnv:
    env = masenvs.make("math", **config)
    env.reset(seed=0, options={"task": HALF})
    return env


def test_agreement_on_the_right_answer_ends_with_success() -> None:
    env = duo()
    _, rewards, terms, truncs, infos = masenvs.play_round(
        env, {"reasoner": "\\boxed{\\frac{1}{2}}", "tool": tool_program("1/2")}
    )
    assert rewards == {"reasoner": 2.0, "tool": 2.0}
    assert all(terms.values()) and not any(truncs.values())
    assert infos["tool"]["success"] and infos["tool"]["answers"] == {
        "reasoner": "\\frac{1}{2}",
        "tool": "1/2",
    }


def test_agreement_on_a_wrong_answer_ends_without_success() -> None:
    env = duo()
    _, rewards, terms, _, infos = masenvs.play_round(
        env, {"reasoner": "\\boxed{3}", "tool": tool_program("3")}
    )
    assert rewards == {"reasoner": 0.0, "tool": 0.0}
    assert all(terms.values()) and not infos["reasoner"]["success"] and env.state.failed


def test_reasoner_sees_the_tools_program_and_answer_in_the_same_round() -> None:
    env = duo()
    assert env.acting == "tool"
    _, rewards, _, _, infos = env.step({"tool": tool_program("1/4")})
    assert rewards == {"tool": 0.0, "reasoner": 0.0} and env.acting == "reasoner"
    prompt = infos["reasoner"]["messages"][-1]["content"]
    assert "Round 1 of 4" in prompt and "print('1/4')" in prompt and "Its answer: 1/4" in prompt
    _, rewards, terms, _, _ = env.step({"reasoner": "Not 1/4: \\boxed{1/2}"})
    assert rewards == {"tool": 1.0, "reasoner": 2.0} and not any(terms.values())


def test_tool_task_print_asks_for_one_print_line_and_the_boxed_answer_at_once() -> None:
    env = masenvs.make("math", tool_task="print", max_rounds=1)
    env.reset(seed=0, options={"task": {"id": "t", "question": "Compute $2 + 3$.", "answer": "5"}})
    tool_system = env.prompt("tool")[0]["content"]
    assert "print(2 + 3 * 4)" in tool_system and "Fraction" not in tool_system
    assert "Answer with one line of Python" in env.prompt("tool")[-1]["content"]
    _, _, _, _, infos = env.step({"tool": "So: print(2 + 3) prints it."})  # no fence needed
    system, user = infos["reasoner"]["messages"]
    assert (
        "at once as \\boxed{answer}" in system["content"]
        and "step by step" not in system["content"]
    )
    assert "print(2 + 3)" in user["content"] and "Its answer: 5" in user["content"]
    _, rewards, terms, _, infos = env.step({"reasoner": "\\boxed{5}"})
    assert rewards == {"tool": 1.0, "reasoner": 2.0} and all(terms.values())  # tool: team only
    assert infos["reasoner"]["success"]
    default = duo()  # the paper's roles stay the default
    assert "step by step" in default.prompt("reasoner")[0]["content"]


def test_disagreement_continues_and_each_sees_the_other() -> None:
    env = duo()
    _, rewards, terms, _, infos = masenvs.play_round(
        env, {"reasoner": "\\boxed{0.5}", "tool": tool_program("0.25")}
    )
    # reasoner right (1) + team (1); tool wrong (0) + team (1)
    assert rewards == {"reasoner": 2.0, "tool": 1.0}
    assert not any(terms.values()) and env.agents
    reasoner_view, tool_view = env.observe("reasoner"), env.observe("tool")
    assert "0.25" in reasoner_view and "print('0.25')" in reasoner_view
    assert "\\boxed{0.5}" in tool_view and "Round 2 of 4" in tool_view


def test_tool_without_code_or_with_a_crash_gets_the_format_penalty() -> None:
    env = duo()
    _, rewards, *_ = masenvs.play_round(
        env, {"reasoner": "\\boxed{0.5}", "tool": "I would print 1/2."}
    )
    assert rewards["tool"] == -1.0 + 1.0  # own penalty + the team's correct answer
    _, rewards, *_ = masenvs.play_round(
        env, {"reasoner": "\\boxed{7}", "tool": "```python\n1/0\n```"}
    )
    assert rewards == {"reasoner": 0.0, "tool": -1.0}
    assert "ZeroDivisionError" in env.observe("tool")


def test_last_round_success_is_the_reasoners_answer() -> None:
    env = duo(max_rounds=1)
    _, _, terms, truncs, infos = masenvs.play_round(
        env, {"reasoner": "\\boxed{1/2}", "tool": tool_program("9")}
    )
    assert all(terms.values()) and infos["reasoner"]["success"]
    env = duo(max_rounds=1)
    _, _, terms, truncs, infos = masenvs.play_round(
        env, {"reasoner": "\\boxed{9}", "tool": tool_program("1/2")}
    )
    assert all(truncs.values()) and not any(terms.values()) and not infos["tool"]["success"]


# --- hostile programs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "program",
    [
        "while True:\n    pass",
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    ],
    ids=["infinite-loop", "fork-bomb"],
)
def test_hostile_tool_programs_time_out(program: str) -> None:
    env = duo(tool_timeout=1.0)
    start = time.monotonic()
    _, rewards, *_ = masenvs.play_round(
        env, {"reasoner": "\\boxed{0.5}", "tool": f"```python\n{program}\n```"}
    )
    assert time.monotonic() - start < 15
    assert env.state.tool_runs[-1].verdict == "timeout"
    assert rewards["tool"] == -1.0 + 1.0


def test_step_works_from_worker_threads() -> None:
    def episode(seed: int) -> float:
        env = masenvs.make("math", single_agent=True)
        env.reset(seed=seed)
        _, rewards, *_ = masenvs.play_round(env, {"reasoner": f"\\boxed{{{env.task.answer}}}"})
        return rewards["reasoner"]

    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(episode, range(6))) == [2.0] * 6


# --- tasks ----------------------------------------------------------------------------------


def test_generated_tasks_are_deterministic_and_cover_every_topic() -> None:
    a = [generate_math_task(np.random.default_rng(s), 2).to_dict() for s in range(50)]
    b = [generate_math_task(np.random.default_rng(s), 2).to_dict() for s in range(50)]
    assert a == b
    assert {t["meta"]["topic"] for t in a} == set(TOPICS)
    for level in (1, 2, 3):
        for seed in range(20):
            task = generate_math_task(np.random.default_rng(seed), level)
            assert default_judge().equal(task.answer, task.answer)  # well-formed answers


def test_generated_answers_are_right() -> None:
    # Recompute a few topics from the question text, independently of the generator.
    for seed in range(40):
        rng = np.random.default_rng(seed)
        task = generate_math_task(rng, 1, ("linear",))
        a, sign, b, c = re.search(r"\$(-?\d+)x ([+-]) (\d+) = (-?\d+)\$", task.question).groups()
        x = int(task.answer)
        assert int(a) * x + (int(b) if sign == "+" else -int(b)) == int(c)
        task = generate_math_task(rng, 1, ("combinatorics",))
        k, n = map(
            int, re.search(r"committee of (\d+) be chosen from (\d+)", task.question).groups()
        )
        assert int(task.answer) == math.comb(n, k)
        task = generate_math_task(rng, 3, ("modular",))
        m = re.search(r"x < (\d+)\$ such that \$(\d+)x", task.question)
        assert int(m[2]) * int(task.answer) % int(m[1]) == 1


def test_config_selects_level_topics_and_rejects_unknown_ones() -> None:
    env = masenvs.make("math", level=1, topics=("fractions",))
    env.reset(seed=3)
    assert env.task.meta == {"topic": "fractions", "level": 1}
    with pytest.raises(ValueError, match="unknown math topics"):
        masenvs.make("math", topics=("poetry",)).reset(seed=0)


def test_reset_accepts_a_task_object_or_a_dict() -> None:
    env = masenvs.make("math")
    obs, _ = env.reset(options={"task": MathTask("t1", "What is 6 times 7?", "42")})
    assert "6 times 7" in obs["reasoner"] and env.task.answer == "42"
    obs, _ = env.reset(options={"task": {"question": "What is 2+2?", "answer": "4"}})
    assert env.task.id.startswith("math-") and "2+2" in obs["tool"]
    with pytest.raises(ValueError, match="no answer"):
        env.reset(options={"task": {"question": "What?"}})


def test_dataset_source_draws_deterministically() -> None:
    def drawn(env: masenvs.MASEnv) -> list[str]:
        ids = []
        for seed in range(8):
            env.reset(seed=seed)
            ids.append(env.task.id)
        return ids

    config = {"source": "hf:aime2024", "data_path": "tests/data/hf/aime2024.jsonl"}
    ids = drawn(masenvs.make("math", **config))
    assert set(ids) == {"aime2024/2024-I-1", "aime2024/2024-II-4"}
    assert drawn(masenvs.make("math", **config)) == ids


@pytest.mark.parametrize("single_agent", [False, True], ids=["multi", "single"])
def test_parallel_api(single_agent: bool) -> None:
    parallel_api_test(masenvs.make("math", single_agent=single_agent), num_cycles=4)


# --- fuzz -----------------------------------------------------------------------------------

_TEXT = st.one_of(
    st.text(max_size=200),
    st.sampled_from(["\\boxed{", "\\boxed{}}", "\\boxed{\\boxed{1}}", "\\boxed{" * 300, "$$"]),
    st.text(alphabet="\\boxed{}0123456789/.$x^", max_size=80),
)


@settings(max_examples=300, deadline=None)
@given(text=_TEXT)
def test_answer_extraction_never_raises(text: str) -> None:
    boxed = last_boxed(text)
    assert boxed is None or isinstance(boxed, str)
    assert printed_answer(text) is None or isinstance(printed_answer(text), str)


@settings(max_examples=25, deadline=None)
@given(texts=st.lists(_TEXT, min_size=2, max_size=2))
def test_any_text_is_a_legal_action(texts: list[str]) -> None:
    env = masenvs.make("math", max_rounds=2)
    env.reset(seed=0)
    while env.agents:
        _, rewards, *_ = env.step(dict(zip(env.agents, texts)))
        assert all(np.isfinite(r) for r in rewards.values())


# --- plain_text and answer_format "number": roles a 135M model can play --------------------

ARITH = {"id": "a", "question": "Compute $35 + 6 \\times 10$.", "answer": "95"}


def plain_duo() -> masenvs.MASEnv:
    env = masenvs.make(
        "math", tool_task="print", plain_text=True, answer_format="number", max_rounds=1
    )
    env.reset(seed=0, options={"task": ARITH})
    return env


def test_plain_text_shows_the_expression_as_python_would_write_it() -> None:
    from masenvs.envs.math import last_number, plain_math

    assert plain_math("Compute $35 + 6 \\times 10$.") == "Compute 35 + 6 * 10."
    assert plain_math("$2^{3} - \\frac{1}{2} \\div 4$") == "2**3 - (1)/(2) / 4"
    assert last_number("So 35 + 60 = 95.") == "95" and last_number("-3 or 1,200") == "1200"
    assert last_number("no digits") is None and last_number("x = -7/2") == "-7/2"
    env = plain_duo()
    tool_prompt = env.prompt("tool")
    assert "Compute 35 + 6 * 10." in tool_prompt[-1]["content"] and "\\times" not in str(
        tool_prompt
    )
    assert "'Compute 2 + 3 * 4.'" in tool_prompt[0]["content"]  # the example in the same form
    default = masenvs.make("math", tool_task="print")
    default.reset(seed=0, options={"task": ARITH})
    assert "Compute $35 + 6 \\times 10$." in default.prompt("tool")[-1]["content"]  # off by default


@pytest.mark.parametrize(
    ("answer", "success", "reasoner_reward"),
    [
        ("95", True, 2.0),
        ("The answer is 95.", True, 2.0),
        ("96", False, 0.0),
        ("none", False, -1.0),
    ],
)
def test_a_plain_number_answer_is_judged(
    answer: str, success: bool, reasoner_reward: float
) -> None:
    env = plain_duo()
    _, _, _, _, infos = env.step({"tool": "print(35 + 6 * 10)"})
    user = infos["reasoner"]["messages"][-1]["content"]
    assert "Its answer: 95" in user and user.endswith(
        "plain number only, e.g. 95 if the tool agent is right:"
    )
    assert "\\boxed" not in infos["reasoner"]["messages"][0]["content"]
    _, rewards, terms, truncs, infos = env.step({"reasoner": answer})
    assert infos["reasoner"]["success"] is success and rewards["reasoner"] == reasoner_reward
    assert all(terms[a] or truncs[a] for a in terms)  # one round: the episode is over


def test_boxed_format_ignores_a_bare_number() -> None:
    env = masenvs.make("math", tool_task="print", max_rounds=1)
    env.reset(seed=0, options={"task": ARITH})
    env.step({"tool": "print(35 + 6 * 10)"})
    _, rewards, _, _, infos = env.step({"reasoner": "95"})  # default: \boxed{} is required
    assert not infos["reasoner"]["success"] and rewards["reasoner"] == -1.0


def test_the_tools_wrong_answer_copied_fails() -> None:
    env = plain_duo()
    _, _, _, _, infos = env.step({"tool": "print(2 + 3 * 4)"})  # the example, not the problem
    assert infos["reasoner"]["messages"][-1]["content"].endswith(
        "e.g. 14 if the tool agent is right:"
    )
    _, rewards, _, _, infos = env.step({"reasoner": "14"})
    assert not infos["reasoner"]["success"] and rewards == {"tool": 0.0, "reasoner": 0.0}
