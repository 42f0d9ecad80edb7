"""An existing agent whose builder takes its LLM clients (`make_graph(solver_llm,
checker_llm)`, `make_team(model_client)`, `make_workflow(llm)`) trains by config alone:
masenvs passes each parameter its agent's framework client. Typos in the mapping or in
`answer_from` stop in the pre-check, before any model loads; an answer read bare from the
graph's state is judged as the answer."""

from __future__ import annotations

import asyncio
import logging
import time
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from masenvs.adapters.frameworks import WorkflowSpec
from masenvs.adapters.frameworks.workflow import check_factory, run_workflow
from masenvs.traces import TraceStore
from masenvs.trainer.config import load_config

AGENTS = Path(__file__).parent / "data" / "client_builders" / "agents.py"


def overrides(tmp_path: Path, builder: str, framework: str, agents: str, *more: str) -> list[str]:
    """Two training steps of `builder` on math, by config only: 1 task x 2 runs, 8 tokens."""
    return [
        f"run_dir={tmp_path / 'run'}",
        "model.name=tiny",
        "lora.rank=4",
        "lora.alpha=8",
        "steps=2",
        "optim.warmup_steps=0",
        "env.name=math",
        "env.options={level: 1}",
        "rollout.branches=2",
        "rollout.tasks_per_step=1",
        "rollout.max_tokens=8",
        "validation.every=0",
        "logging.tensorboard=false",
        "logging.plot_every=0",
        f"workflow.factory={AGENTS}:{builder}",
        f"workflow.framework={framework}",
        f"workflow.agents={agents}",
        *more,
    ]


BUILDERS = {
    # the parameters name the agents: inferred, and said once
    "langgraph": ("make_graph", "[solver, checker]", "workflow.input={question: '{task}'}",
                  "workflow.answer_from=answer"),
    # a lone agent: `model_client` is its client
    "autogen": ("make_team", "[solver]"),
    # mapped in the config
    "llamaindex": ("make_workflow", "[solver]", "workflow.llm_args={llm: solver}"),
}  # fmt: skip


@pytest.mark.parametrize("framework", list(BUILDERS))
def test_a_builder_taking_clients_trains_by_config_alone(
    tmp_path: Path, framework: str, caplog: pytest.LogCaptureFixture
) -> None:
    from masenvs.trainer.run.train import train

    builder, agents, *more = BUILDERS[framework]
    cfg = load_config(None, overrides(tmp_path, builder, framework, agents, *more))
    with caplog.at_level(logging.WARNING, "masenvs.frameworks"):
        train(cfg)
    run = tmp_path / "run"
    assert (run / "checkpoints" / "step_00000002").is_dir()
    store = TraceStore(run / "traces")
    episodes = list(store.episodes())
    assert len(episodes) == 4  # 2 steps x 1 task x 2 runs
    for episode in episodes:
        assert episode.extra["error"] is None, episode.extra["error_detail"]
    calls = list(store.calls())
    expected = {"solver", "checker"} if framework == "langgraph" else {"solver"}
    assert {c.agent for c in calls} == expected  # each parameter got its agent's client
    inferred = [r.getMessage() for r in caplog.records if "inferred" in r.getMessage()]
    if framework == "llamaindex":
        assert not inferred  # mapped in the config: nothing to say
    else:
        assert len(inferred) == 1, inferred
        said = "solver_llm -> solver, checker_llm -> checker"
        assert (said if framework == "langgraph" else "model_client -> solver") in inferred[0]


def pre_check(tmp_path: Path, *more: str) -> tuple[int, str, float]:
    """`masenvs train`'s pre-check as the command runs it: exit status, output, seconds."""
    from masenvs.trainer.commands.train import run

    cfg = load_config(None, overrides(tmp_path, "make_graph", "langgraph", "[solver, checker]",
                                      "workflow.input={question: '{task}'}", *more))  # fmt: skip
    out = StringIO()
    started = time.perf_counter()
    status = run(cfg, Console(file=out, width=400))
    return status, out.getvalue(), time.perf_counter() - started


def test_an_answer_from_typo_stops_in_the_pre_check_with_did_you_mean(tmp_path: Path) -> None:
    status, out, seconds = pre_check(tmp_path, "workflow.answer_from=answr")
    assert status == 2
    assert "workflow.answer_from='answr' is not a key of the graph's state" in out
    assert "did you mean 'answer'?" in out
    assert seconds < 30 and not (tmp_path / "run").exists()  # no model loaded, no run


def test_an_autogen_answer_from_typo_names_the_team_s_agents() -> None:
    spec = WorkflowSpec(
        factory=f"{AGENTS}:make_team", framework="autogen", agents=["solver"], answer_from="solvr"
    )
    with pytest.raises(ValueError, match="did you mean 'solver'\\? its agents: solver"):
        check_factory(spec, "math")


def test_an_unmappable_parameter_names_it_and_the_key_to_set(tmp_path: Path) -> None:
    status, out, _ = pre_check(tmp_path, "workflow.agents=[writer, critic]")
    assert status == 2
    assert "takes solver_llm, checker_llm, which masenvs cannot map" in out
    assert "workflow.llm_args, e.g. {solver_llm: writer}" in out
    status, out, _ = pre_check(tmp_path, "workflow.llm_args={solver: solver}")
    assert status == 2 and "workflow.llm_args maps 'solver', which factory" in out


def test_a_factory_taking_the_context_still_gets_it() -> None:
    spec = WorkflowSpec(
        factory="framework_programs:langgraph_pair",
        framework="langgraph",
        agents=["solver", "checker"],
    )
    check_factory(spec, "math")  # builds the program with the context, as before


def test_a_bare_answer_read_from_the_state_is_judged_as_the_answer() -> None:
    """The math env asks for \\boxed{}; the graph's `answer` key holds '14' or '\\frac{3}{4}'."""
    spec = WorkflowSpec(
        factory=f"{AGENTS}:make_oracle",
        framework="langgraph",
        agents=["solver"],
        input={"question": "{task}", "seed": "{seed}"},
        answer_from="answer",
    )
    options: dict[str, Any] = {"level": 1}
    for seed in range(3):
        run = asyncio.run(
            run_workflow(
                spec, root_url="http://127.0.0.1:9", env_name="math", seed=seed, env_options=options
            )  # fmt: skip
        )
        assert "\\boxed" not in run.answer and run.error is None
        assert run.success and run.reward > 0, (run.answer, run.reward)
