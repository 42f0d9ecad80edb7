"""The auto_mas env and its training: rewards and failure causes, executions captured as
executor samples in question or design groups, the role schedule, and 2-step runs of
examples/auto_mas.yaml on the tiny model; the paper config as written (tests/test_paper_configs.py
trains it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from framework_support import serve

import masenvs
from masenvs.engine.engine import EmbeddedBackend
from masenvs.mas.cli import main as mas_graph
from masenvs.trainer.config import ScheduleConfig, load_config
from masenvs.trainer.rollout.captured import captured_samples
from masenvs.trainer.run.train import train

ROOT = Path(__file__).resolve().parents[1]
MATH = {"id": "two-plus-two", "question": "What is 2 + 2?", "answer": "4"}
CODE = {
    "id": "add",
    "prompt": "Read two integers and print their sum.",
    "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}],
}


def design(body: str) -> str:
    return f"Here is my team.\n<code>\n{body}\n</code>"


def answers(text: str) -> str:
    return design(f"async def solve(messages):\n    return {text!r}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=32, max_model_len=1024)
    policies = {"executor": "base", "designer": "base"}
    with serve(engine, tmp_path_factory.mktemp("t") / "traces", policy_map=policies) as s:
        yield s
    engine.shutdown()


def step(env, action: str):
    _, rewards, terms, truncs, infos = env.step({"designer": action})
    return rewards["designer"], infos["designer"]


def test_a_correct_design_scores_correctness_plus_a_small_answer_bonus(served) -> None:
    env = masenvs.make("auto_mas", endpoint_url=served.url, executions=2, max_rounds=1)
    env.reset(options={"task": MATH})
    reward, info = step(env, answers("so \\boxed{4}"))
    assert reward == pytest.approx(1.05) and info["success"] and info["error"] is None
    assert [e["score"] for e in info["executions"]] == [1.05, 1.05]
    env.reset(options={"task": MATH})
    reward, info = step(env, answers("\\boxed{5}"))
    assert reward == pytest.approx(0.05) and not info["success"]  # format never beats truth
    env.reset(options={"task": MATH})
    reward, info = step(env, answers("four, I think"))
    assert reward == 0.0


def test_code_designs_score_the_hidden_test_pass_ratio(served) -> None:
    env = masenvs.make("auto_mas", task="code", endpoint_url=served.url, executions=1)
    env.reset(options={"task": CODE})
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    reward, info = step(env, answers(program))
    assert reward == pytest.approx(1.05) and info["success"]
    env.reset(options={"task": CODE})
    reward, _ = step(env, answers("```python\nprint(3)\n```"))
    assert reward == pytest.approx(0.55)  # one of two tests


@pytest.mark.parametrize(
    ("action", "cause"),
    [
        ("I would use three agents.", "no design"),
        (design("system = ("), "syntax error"),
        (design("raise ValueError('boom')"), "error: ValueError: boom"),
        (design("async def solve(messages):\n    return ''"), "no answer"),
        (design("while True:\n    pass"), "timeout"),
    ],
)
def test_a_failing_design_scores_zero_and_records_why(served, action, cause) -> None:
    env = masenvs.make("auto_mas", endpoint_url=served.url, executions=2, design_seconds=4)
    env.reset(seed=0)
    reward, info = step(env, action)
    assert reward == 0.0 and cause in info["error"]
    assert all(e["score"] == 0.0 for e in info["executions"])
    assert env.agents == ["designer"]  # a second design is allowed (max_rounds 2)
    assert cause in env.prompt("designer")[-1]["content"]  # and sees why the first failed


def test_without_an_endpoint_a_design_fails_with_that_cause() -> None:
    env = masenvs.make("auto_mas", executions=1)
    env.reset(seed=0)
    reward, info = step(env, answers("\\boxed{1}"))
    assert reward == 0.0 and "endpoint_url" in info["error"]


def test_every_execution_is_captured_under_its_own_rollout(served) -> None:
    env = masenvs.make("auto_mas", endpoint_url=served.url, executions=3, max_tokens=4)
    env.reset(seed=3)
    _, info = step(env, design('system = Sequential(Agent("a"), Agent("b"))'))
    captured = info["captured"]
    assert [c["rollout_id"] for c in captured] == [f"mas-{info['design_id']}-{m}" for m in range(3)]
    assert {c["agent"] for c in captured} == {"executor"}
    for c in captured:
        calls = served.store.rollout(c["rollout_id"])
        assert len(calls) == 2 and {r.agent for r in calls} == {"executor"}
    assert info["graph"]["structure"] == "Sequential(a, b)"


def test_single_agent_mode_plays_both_roles_with_one_policy(served) -> None:
    env = masenvs.make("auto_mas", single_agent=True, endpoint_url=served.url, executions=1)
    assert env.possible_agents == ["designer"] and env.callers == []
    env.reset(seed=0)
    _, info = step(env, design('system = Agent("a")'))
    assert info["captured"][0]["agent"] == "designer"
    assert {r.agent for r in served.store.rollout(info["captured"][0]["rollout_id"])} == {
        "designer"
    }
    assert masenvs.make("auto_mas").callers == ["executor"]


def test_a_format_bonus_over_a_tenth_of_correctness_is_refused() -> None:
    with pytest.raises(ValueError, match="must not outweigh"):
        masenvs.make("auto_mas", answer_bonus=0.4)


def test_executor_groups_per_question_or_per_design(served) -> None:
    env = masenvs.make("auto_mas", endpoint_url=served.url, executions=2, max_tokens=4)
    captured, task_of = [], {}
    for action in (design('system = Agent("a")'), design('system = Agent("b")')):
        env.reset(seed=7)
        _, info = step(env, action)
        captured += info["captured"]
        task_of.update({c["rollout_id"]: "auto_mas:7" for c in info["captured"]})

    def groups(by: str) -> dict:
        samples = captured_samples(
            served.store, captured, task_of=task_of, policy_of=lambda a: a, group_by=by
        )
        out: dict = {}
        for s in samples:
            out.setdefault(s.group, []).append(s)
        return out

    question = groups("question")
    assert list(question) == [("caller", "auto_mas:7", "executor")]
    assert len(question[("caller", "auto_mas:7", "executor")]) == 4  # 2 designs x 2 runs
    per_design = groups("design")
    assert len(per_design) == 2 and all(len(v) == 2 for v in per_design.values())
    for members in per_design.values():
        assert {s.reward for s in members} <= {c["reward"] for c in captured}


def test_the_schedule_alternates_phases_and_scales_the_off_role() -> None:
    phases = ScheduleConfig(alternate=["executor", "designer"], every=2)
    assert [phases.phase(s) for s in range(1, 7)] == ["executor"] * 2 + ["designer"] * 2 + [
        "executor"
    ] * 2
    assert phases.scale(1, "designer") == 0.0 and phases.scale(3, "designer") == 1.0
    assert phases.scale(1, "critic") == 1.0  # a role not listed always trains
    lr = ScheduleConfig(alternate=["executor", "designer"], every=30, mode="lr", off_lr_scale=0.2)
    assert lr.scale(31, "executor") == 0.2 and lr.scale(31, "designer") == 1.0
    assert ScheduleConfig().phase(5) is None


GOOD_DESIGN = 'a = Agent("solver", "Answer with \\\\boxed{}.")\nsystem = Ensemble(a, Agent("b"), judge=Agent("j"))'


def test_two_tiny_steps_of_examples_auto_mas_train_both_roles_in_turn(
    tmp_path, monkeypatch
) -> None:
    # The tiny model writes noise, never a design: its replies are swapped for one, so the
    # run exercises what a real designer's would (executions, captured calls, both phases).
    import masenvs.envs.auto_mas as auto_mas

    monkeypatch.setattr(auto_mas, "extract_design", lambda text: GOOD_DESIGN)
    cfg = load_config(
        ROOT / "examples" / "auto_mas.yaml",
        [
            "model.name=tiny",
            f"run_dir={tmp_path / 'run'}",
            "steps=2",
            "schedule.every=1",
            "validation.every=2",
            "validation.episodes=1",
            "env.options.max_tokens=6",
            "rollout.max_tokens=12",
        ],
    )
    result = train(cfg)
    rows = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    trained = {r["step"]: r for r in rows if "time/update_s" in r}
    assert trained[1]["schedule/phase"] == 0.0 and trained[2]["schedule/phase"] == 1.0
    assert trained[1]["train/captured_runs"] == 8  # 2 tasks x 2 designs x 2 runs
    assert "learner/executor/samples" in trained[1] and "learner/designer/samples" not in trained[1]
    assert "learner/designer/samples" in trained[2] and "learner/executor/samples" not in trained[2]
    designs = [
        json.loads(line) for line in (result.run_dir / "designs.jsonl").read_text().splitlines()
    ]
    assert len(designs) == 8 and all(
        d["graph"]["structure"] == "Ensemble(solver, b, j)" for d in designs
    )
    checkpoint = result.run_dir / "checkpoints" / "step_00000002" / "adapters"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["designer", "executor"]
    png = tmp_path / "design.png"
    assert mas_graph([str(result.run_dir), "-o", str(png)]) == 0 and png.stat().st_size > 10_000


def test_the_paper_config_is_the_papers_experiment() -> None:
    # tests/test_paper_configs.py trains it (2 tiny steps, checkpoint checked) with the rest.
    cfg = load_config(ROOT / "examples" / "paper" / "auto_mas_qwen3_8b.yaml")
    assert cfg.rollout.branches == 4 and cfg.env.options["executions"] == 4  # N x M = 4 x 4
    assert cfg.schedule.every == 30 and cfg.policy.mode == "shared"
    # The paper's lengths (8192 for designer and executor) and its math + code mixture.
    assert cfg.rollout.max_tokens == 8192 and cfg.env.options["max_tokens"] == 8192
    assert cfg.env.options["task"] == "mixed"
    assert cfg.env.options["code_sources"] == {"hf:apps": 0.7, "hf:code_contests": 0.3}


def test_mas_graph_explains_a_run_without_designs(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit, match="no designs"):
        mas_graph([str(tmp_path)])
    (tmp_path / "designs.jsonl").write_text(
        json.dumps({"step": 1, "design_id": "x", "graph": None, "error": "no design"}) + "\n"
    )
    with pytest.raises(SystemExit, match="executed far enough"):
        mas_graph([str(tmp_path)])
    assert mas_graph([str(tmp_path), "--list"]) == 0
    assert "no design" in capsys.readouterr().out
    sys.stdout.flush()


def test_masenvs_rollout_points_the_designs_at_its_own_endpoint(tmp_path, monkeypatch) -> None:
    import masenvs.envs.auto_mas as auto_mas
    from masenvs.adapters.rollout import main as rollout
    from masenvs.traces import TraceStore

    monkeypatch.setattr(auto_mas, "extract_design", lambda text: GOOD_DESIGN)
    argv = ["--env", "auto_mas", "--model", "tiny", "--episodes", "1", "--max-tokens", "8"]
    argv += ["--set", "max_rounds=1", "--set", "executions=1", "--set", "max_tokens=4"]
    assert rollout([*argv, "--traces", str(tmp_path)]) == 0
    agents = [c.agent for c in TraceStore(tmp_path).calls()]
    assert agents.count("designer") == 1 and agents.count("executor") == 3  # a, b, judge
