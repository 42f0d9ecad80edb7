"""Workflow mode with the real frameworks against the real endpoint (uvicorn on loopback).

A LangGraph graph, an AutoGen team and LlamaIndex workflows solve env tasks K times each;
every call they make must be in the trace under its run, attributed to its agent, served by
that agent's adapter, numbered 0, 1, ... per agent, and turned into samples grouped by
(task, agent, call index) with the run's reward. Failures end one run, never the batch.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from framework_support import random_lora, serve

from masenvs.adapters.frameworks import Clients, ClientSettings, WorkflowSpec, load_factory
from masenvs.adapters.frameworks.calls import read_calls
from masenvs.adapters.frameworks.clients import rollout_url
from masenvs.adapters.frameworks.langgraph import answer_text
from masenvs.adapters.frameworks.workflow import run_tasks, run_workflow
from masenvs.adapters.policy import Sampling, server_root
from masenvs.adapters.rollout import main as rollout_main
from masenvs.engine.engine import EmbeddedBackend
from masenvs.registry import make
from masenvs.traces import TraceStore
from masenvs.trainer.rollout.workflow import collect_workflow_samples, workflow_samples
from masenvs.trainer.samples import workflow_group

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ClientSettings(sampling=Sampling(max_tokens=12))
ADAPTERS = ("lora_a", "lora_b", "shared")


@pytest.fixture(scope="module")
def backend() -> Iterator[EmbeddedBackend]:
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=32, max_model_len=1024)
    for seed, name in enumerate(ADAPTERS, start=1):
        random_lora(engine, name, seed)
    yield engine
    engine.shutdown()


CASES = [
    ("langgraph", "framework_programs:langgraph_pair", ["solver", "checker"]),
    ("autogen", "framework_programs:autogen_pair", ["coder", "reviewer"]),
    ("llamaindex", "framework_programs:llamaindex_pair", ["drafter", "critic"]),
]


@pytest.mark.parametrize(("framework", "factory", "agents"), CASES, ids=[c[0] for c in CASES])
def test_every_call_is_traced_attributed_routed_and_numbered(
    backend, tmp_path, framework, factory, agents
) -> None:
    routes = dict(zip(agents, ("lora_a", "lora_b")))
    spec = WorkflowSpec(factory=factory, framework=framework, agents=agents)
    with serve(backend, tmp_path / "traces", policy_map=routes) as served:
        samples, runs = asyncio.run(
            collect_workflow_samples(
                spec,
                root_url=served.url,
                store=served.store,
                env_name="math",
                env_options={"level": 1},
                seeds=[3, 4],
                branches=2,
                settings=SETTINGS,
                endpoint=served.endpoint,
                step=7,
            )
        )
        calls = list(served.store.calls())
        episodes = list(served.store.episodes())

    assert [(r.seed, r.run_index) for r in runs] == [(3, 0), (3, 1), (4, 0), (4, 1)]
    assert [r.error for r in runs] == [None] * 4
    assert {r.rollout_id for r in runs} == {"s7-3-0", "s7-3-1", "s7-4-0", "s7-4-1"}
    # Every call of every run is in the trace: two per agent, numbered 0 and 1 in order of
    # arrival, served by the agent's own adapter.
    assert len(calls) == 4 * 2 * len(agents)
    by_run: dict[tuple[str, str], list] = defaultdict(list)
    for call in calls:
        assert call.agent in agents
        assert call.model == routes[call.agent]
        assert call.choices[0].token_ids and call.prompt_token_ids
        by_run[(call.rollout_id, call.agent)].append(call)
    assert set(by_run) == {(r.rollout_id, a) for r in runs for a in agents}
    for mine in by_run.values():
        mine.sort(key=lambda c: c.started_at)
        assert [c.call_index for c in mine] == [0, 1]
        assert mine[0].metadata["task_id"] == f"math:{mine[0].metadata['seed']}"
    # One sample per call, in groups (task, agent, call index) of K = 2 runs.
    assert len(samples) == len(calls)
    groups: dict[tuple, list] = defaultdict(list)
    for s in samples:
        groups[s.group].append(s)
        assert s.policy == routes[s.agent]
        run = next(r for r in runs if r.rollout_id == s.meta["rollout_id"])
        assert s.reward == run.reward
        assert s.group == workflow_group(run.task_id, s.agent, s.meta["call_index"])
    assert len(groups) == 2 * len(agents) * 2
    assert all(len(members) == 2 for members in groups.values())
    # The env scored each run, and the outcome is stored next to the calls.
    assert {e.rollout_id for e in episodes} == {r.rollout_id for r in runs}
    for e in episodes:
        assert set(e.rewards) == set(agents)
        assert e.extra["mode"] == "workflow"


def test_a_shared_adapter_serves_and_trains_every_agent(backend, tmp_path) -> None:
    agents = ["solver", "checker"]
    spec = WorkflowSpec(
        factory="framework_programs:langgraph_pair", framework="langgraph", agents=agents
    )
    with serve(backend, tmp_path, policy_map=dict.fromkeys(agents, "shared")) as served:
        samples, runs = asyncio.run(
            collect_workflow_samples(
                spec,
                root_url=served.url,
                store=served.store,
                env_name="plan_path",
                seeds=[0],
                branches=2,
                settings=SETTINGS,
                policy_of=lambda agent: "shared",
            )
        )
    assert len(samples) == 2 * 2 * len(agents)
    assert {s.meta["served_by"] for s in samples} == {"shared"}
    assert {s.policy for s in samples} == {"shared"}
    assert {s.agent for s in samples} == set(agents)  # groups still keep agents apart
    # plan-path's rates beside success (tests/test_plan_path_success.py), per run
    assert all(set(r.metrics) == {"optimal", "exact_stop"} for r in runs if r.error is None)


def test_an_agent_workflow_and_the_example_programs_run(backend, tmp_path) -> None:
    """LlamaIndex AgentWorkflow (tools rendered by no template), and the shipped examples."""
    cases = [
        ("llamaindex", "framework_programs:llamaindex_agents", ["planner", "critic"], "math"),
        ("langgraph", f"{ROOT}/examples/langgraph_math.py:build", ["solver", "verifier"], "math"),
        ("autogen", f"{ROOT}/examples/autogen_code.py:build", ["coder", "reviewer"], "code"),
        (
            "llamaindex",
            f"{ROOT}/examples/llamaindex_plan_path.py:build",
            ["navigator", "reviewer"],
            "plan_path",
        ),
    ]
    with serve(backend, tmp_path) as served:
        for framework, factory, agents, env in cases:
            spec = WorkflowSpec(factory=factory, framework=framework, agents=agents)
            (run,) = asyncio.run(
                run_tasks(
                    spec,
                    root_url=served.url,
                    env_name=env,
                    seeds=[1],
                    branches=1,
                    settings=SETTINGS,
                    store=served.store,
                    prefix=framework + env,
                )
            )
            assert run.error is None, (factory, run.error)
            calls = served.store.rollout(run.rollout_id)
            assert calls and {c.agent for c in calls} <= set(agents)
            assert agents[0] in {c.agent for c in calls}


def test_a_selector_group_chat_traces_its_speaker_selection_as_an_agent(backend, tmp_path) -> None:
    agents = ["coder", "reviewer", "selector"]
    spec = WorkflowSpec(
        factory="framework_programs:autogen_selector", framework="autogen", agents=agents
    )
    with serve(backend, tmp_path) as served:
        (run,) = asyncio.run(
            run_tasks(
                spec,
                root_url=served.url,
                env_name="code",
                seeds=[0],
                branches=1,
                settings=SETTINGS,
            )
        )
        calls = served.store.rollout(run.rollout_id)
    assert run.error is None
    by_agent = defaultdict(list)
    for call in calls:
        by_agent[call.agent].append(call.call_index)
    assert set(by_agent) == set(agents)  # the selector's own calls are an agent's calls
    assert all(indices == list(range(len(indices))) for indices in by_agent.values())


def test_a_failing_user_graph_ends_its_run_with_the_failure_reward(backend, tmp_path) -> None:
    spec = WorkflowSpec(
        factory="framework_programs:langgraph_fails_first_run",
        framework="langgraph",
        agents=["solver"],
    )
    with serve(backend, tmp_path) as served:
        samples, runs = asyncio.run(
            collect_workflow_samples(
                spec,
                root_url=served.url,
                store=served.store,
                env_name="math",
                seeds=[0, 1],
                branches=2,
                settings=SETTINGS,
            )
        )
    failed = [r for r in runs if r.error]
    assert [r.run_index for r in failed] == [0, 0]  # the other runs went on and finished
    assert all(r.error.startswith("ValueError: boom") for r in failed)
    assert all(not r.success and r.answer == "" for r in failed)
    # Default failure reward: the env's score of an empty answer (math: format penalty).
    env = make("math", single_agent=True, max_rounds=1)
    env.reset(seed=0)
    _, rewards, *_ = env.step({"reasoner": ""})
    assert {r.reward for r in failed} == {rewards["reasoner"]}
    # The call made before the failure is still a sample, with the failure reward.
    failed_samples = [s for s in samples if s.meta["failed"]]
    assert len(failed_samples) == 2
    assert all(s.reward == rewards["reasoner"] for s in failed_samples)

    spec.failure_reward = -3.0
    with serve(backend, tmp_path / "again") as served:
        runs = asyncio.run(
            run_tasks(
                spec,
                root_url=served.url,
                env_name="math",
                seeds=[0],
                branches=2,
                settings=SETTINGS,
            )
        )
    assert [r.reward for r in runs if r.error] == [-3.0]


@pytest.mark.parametrize(
    ("factory", "limits", "reason"),
    [
        ("framework_programs:langgraph_forever", {"recursion_limit": 3}, "GraphRecursionError"),
        ("framework_programs:sleeps", {"timeout_s": 0.5}, "ProgramTimeout"),
        ("framework_programs:not_a_program", {}, "TypeError: framework 'langgraph' expects"),
    ],
    ids=["recursion-limit", "timeout", "not-a-program"],
)
def test_framework_failures_are_logged_and_scored(
    backend, tmp_path, caplog, factory, limits, reason
) -> None:
    spec = WorkflowSpec(factory=factory, framework="langgraph", agents=["solver"], **limits)
    with serve(backend, tmp_path) as served:
        run = asyncio.run(
            run_workflow(
                spec,
                root_url=served.url,
                env_name="plan_path",
                seed=0,
                settings=SETTINGS,
                store=served.store,
                rollout_id="r-fail",
            )
        )
        (episode,) = served.store.episodes("r-fail")
        calls = served.store.rollout("r-fail")
    assert run.error is not None and run.error.startswith(reason)
    assert "\n" not in run.error
    assert reason.split(":")[0] in caplog.text and "r-fail" in caplog.text
    assert episode.extra["error"] == run.error and not episode.success
    if "recursion" in factory:
        assert len(calls) == 3  # one call per super-step until the limit


def test_load_factory_forms_and_errors(tmp_path, monkeypatch) -> None:
    assert load_factory("framework_programs:autogen_pair").__name__ == "autogen_pair"
    path_ref = f"{ROOT}/examples/autogen_code.py:build"
    assert load_factory(path_ref).__name__ == "build"
    monkeypatch.chdir(ROOT)  # `examples.x:build` from the repo root, as `masenvs train` runs
    assert load_factory("examples.langgraph_math:build").__module__.endswith("langgraph_math")
    with pytest.raises(ValueError, match="must look like 'module:function'"):
        load_factory("no_colon")
    with pytest.raises(ValueError, match="cannot import"):
        load_factory("no_such_module_anywhere:build")
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_factory("framework_programs:nope")
    with pytest.raises(ValueError, match="does not exist"):
        load_factory(f"{tmp_path}/missing.py:build")


def test_clients_refuse_undeclared_agents_and_answers_are_read_from_state() -> None:
    from langchain_core.messages import AIMessage, HumanMessage

    clients = Clients("langgraph", "http://127.0.0.1:9/r/x/v1", ["solver"], SETTINGS)
    assert clients["solver"].model_name == "solver"
    assert list(clients) == ["solver"] and "checker" not in clients
    with pytest.raises(KeyError, match="add it to `agents`"):
        clients["checker"]
    asyncio.run(clients.aclose())
    state = {"messages": [HumanMessage("q"), AIMessage("first"), HumanMessage("x")], "n": 3}
    assert answer_text(state) == "first"  # the last AI message
    assert answer_text(state, "n") == "3"
    with pytest.raises(KeyError, match="not a key"):
        answer_text(state, "answer")
    with pytest.raises(ValueError, match="at least 1"):
        WorkflowSpec(factory="m:f", framework="langgraph", agents=[])


BLOCKING = [
    ("langgraph", "framework_programs:langgraph_blocking", ["solver"]),
    ("autogen", "framework_programs:autogen_blocking", ["coder"]),
    ("llamaindex", "framework_programs:llamaindex_blocking", ["drafter"]),
]


def _wait_for_late_call(rollout_id: str) -> str:
    """What the hung run's call after its sleep got (the hung thread records it)."""
    from framework_programs import LATE

    deadline = time.monotonic() + 30
    while rollout_id not in LATE and time.monotonic() < deadline:
        time.sleep(0.05)
    return LATE[rollout_id]


@pytest.mark.parametrize(("framework", "factory", "agents"), BLOCKING, ids=[c[0] for c in BLOCKING])
def test_a_blocking_run_times_out_alone_and_its_late_calls_are_refused(
    backend, tmp_path, framework, factory, agents
) -> None:
    """`time.sleep` in one run's async code: only that run times out, on time."""
    from framework_programs import BLOCK_S, LATE

    LATE.clear()
    spec = WorkflowSpec(factory=factory, framework=framework, agents=agents, timeout_s=5)
    with serve(backend, tmp_path) as served:
        # A first run imports the framework (seconds on a busy CPU), inside its deadline.
        options = dict(root_url=served.url, env_name="math", settings=SETTINGS)
        asyncio.run(run_tasks(spec, seeds=[1], branches=1, prefix="warm", **options))
        started = time.perf_counter()
        samples, runs = asyncio.run(
            collect_workflow_samples(
                spec,
                root_url=served.url,
                store=served.store,
                env_name="math",
                seeds=[0, 1],
                branches=2,
                settings=SETTINGS,
                endpoint=served.endpoint,
            )
        )
        elapsed = time.perf_counter() - started
        hung, others = runs[0], runs[1:]
        late = _wait_for_late_call(hung.rollout_id)
        calls = list(served.store.calls())
    assert (hung.seed, hung.run_index) == (0, 0)
    assert hung.error == "ProgramTimeout: the program ran past timeout_s=5"
    assert [r.error for r in others] == [None, None, None]  # no other run was marked
    assert elapsed < BLOCK_S  # the blocked thread stalled neither the other runs nor us
    # Its call after the sleep was cancelled or refused: never sent, never trained.
    assert late.startswith(("CancelledError", "RunEnded")), late
    assert hung.rollout_id not in {c.rollout_id for c in calls}
    assert {s.meta["rollout_id"] for s in samples} == {r.rollout_id for r in others}


@pytest.mark.parametrize("with_endpoint", [True, False], ids=["endpoint", "no-endpoint"])
def test_late_calls_of_a_timed_out_run_never_train(backend, tmp_path, with_endpoint) -> None:
    """A program with its own client: the endpoint refuses its late call; without the
    endpoint object (a remote server), the call is recorded but never becomes a sample."""
    from framework_programs import LATE

    LATE.clear()
    spec = WorkflowSpec(
        factory="framework_programs:own_client_blocking",
        framework="langgraph",
        agents=["solver"],
        timeout_s=4,
    )
    with serve(backend, tmp_path) as served:
        runs = asyncio.run(
            run_tasks(
                spec,
                root_url=served.url,
                env_name="math",
                seeds=[0],
                branches=2,
                settings=SETTINGS,
                endpoint=served.endpoint if with_endpoint else None,
                prefix="ep" if with_endpoint else "remote",
            )
        )
        late = _wait_for_late_call(runs[0].rollout_id)
        calls = read_calls(served.store, [r.rollout_id for r in runs])
    assert runs[0].error.startswith("ProgramTimeout") and runs[1].error is None
    samples = workflow_samples(runs, calls)
    assert {s.meta["rollout_id"] for s in samples} == {runs[1].rollout_id}
    if with_endpoint:
        assert late.startswith("409") and "Rollout 'ep-0-0' has ended" in late, late
        assert runs[0].rollout_id not in {c.rollout_id for c in calls}
    else:
        assert late == "sent"  # it reached the server and is in the trace...
        late_calls = [c for c in calls if c.rollout_id == runs[0].rollout_id]
        assert late_calls  # (its thread may make one more call after this one)
        assert all(c.started_at > runs[0].ended_at for c in late_calls)  # ...so: no sample


FAILING = [
    ("langgraph", "framework_programs:langgraph_fails_first_run", ["solver"]),
    ("autogen", "framework_programs:autogen_fails", ["coder"]),
    ("llamaindex", "framework_programs:llamaindex_fails", ["drafter"]),
]


@pytest.mark.parametrize(("framework", "factory", "agents"), FAILING, ids=[c[0] for c in FAILING])
def test_each_failed_run_is_logged_once_in_one_line_with_the_detail_in_its_record(
    backend, tmp_path, caplog, framework, factory, agents
) -> None:
    spec = WorkflowSpec(factory=factory, framework=framework, agents=agents)
    caplog.set_level(logging.WARNING)
    with serve(backend, tmp_path) as served:
        (run,) = asyncio.run(
            run_tasks(
                spec,
                root_url=served.url,
                env_name="math",
                seeds=[0],
                branches=1,
                settings=SETTINGS,
                store=served.store,
            )
        )
        (episode,) = served.store.episodes(run.rollout_id)
    assert run.error is not None and "boom in the user's" in run.error
    # One log record in all, one line, naming the run; AutoGen's own traceback is not logged.
    assert [r.getMessage().count("\n") for r in caplog.records] == [0], caplog.text
    assert run.rollout_id in caplog.records[0].getMessage()
    # The record holds the whole story: the traceback (and AutoGen's log of it).
    detail = episode.extra["error_detail"]
    assert episode.extra["error"] == run.error
    assert "Traceback (most recent call last)" in detail and "with a second line" in detail
    if framework == "autogen":
        assert "framework logs of this run:" in detail and "autogen_core" in detail


WRONG_TYPES = [
    ("langgraph", "returns_a_list", "the program returned a list, not text"),
    ("langgraph", "langgraph_answer_dict", "state key answer_from='answer' holds a dict"),
    ("autogen", "autogen_returns_none", "the program returned None, not text"),
    ("llamaindex", "llamaindex_stops_with_a_list", "the workflow stopped with a list"),
]


@pytest.mark.parametrize(
    ("framework", "factory", "reason"), WRONG_TYPES, ids=[c[1] for c in WRONG_TYPES]
)
def test_an_answer_that_is_not_text_fails_the_run_instead_of_being_scored(
    backend, tmp_path, framework, factory, reason
) -> None:
    """A list whose repr holds `\\boxed{9}` once scored as correct; now it fails the run."""
    agents = {"langgraph": ["solver"], "autogen": ["coder"], "llamaindex": ["drafter"]}
    answer_from = "answer" if factory == "langgraph_answer_dict" else None
    spec = WorkflowSpec(
        factory=f"framework_programs:{factory}",
        framework=framework,
        agents=agents[framework],
        answer_from=answer_from,
    )
    with serve(backend, tmp_path) as served:
        run = asyncio.run(
            run_workflow(spec, root_url=served.url, env_name="math", seed=0, settings=SETTINGS)
        )
    assert run.error is not None and run.error.startswith(f"AnswerTypeError: {reason}")
    assert run.answer == "" and not run.success
    env = make("math", single_agent=True, max_rounds=1)
    env.reset(seed=0)
    _, rewards, *_ = env.step({"reasoner": ""})
    assert run.reward == rewards["reasoner"]  # scored as no answer, not as its repr


EMPTY = [
    ("langgraph", "langgraph_custom_key", ["solver"], "set answer_from to that key"),
    ("autogen", "autogen_quiet_last_speaker", ["coder"], "set answer_from to the agent"),
    ("llamaindex", "llamaindex_empty_result", ["drafter"], "StopEvent(result=answer_text)"),
]


@pytest.mark.parametrize(
    ("framework", "factory", "agents", "hint"), EMPTY, ids=[c[0] for c in EMPTY]
)
def test_an_empty_answer_is_warned_about_once_naming_answer_from(
    backend, tmp_path, caplog, framework, factory, agents, hint
) -> None:
    spec = WorkflowSpec(factory=f"framework_programs:{factory}", framework=framework, agents=agents)
    caplog.set_level(logging.WARNING)
    with serve(backend, tmp_path) as served:
        runs = asyncio.run(
            run_tasks(
                spec,
                root_url=served.url,
                env_name="math",
                seeds=[0, 1],
                branches=2,
                settings=SETTINGS,
            )
        )
    assert [(r.error, r.answer) for r in runs] == [(None, "")] * 4
    (warning,) = caplog.records  # once for the program, not once per run
    assert "final answer is empty" in warning.getMessage() and hint in warning.getMessage()
    assert spec.factory in warning.getMessage()


TOOLS = [
    ("langgraph", "langgraph_with_tool", "solver"),
    ("autogen", "autogen_with_tool", "coder"),
    ("llamaindex", "llamaindex_with_tool", "drafter"),
]


@pytest.mark.parametrize(("framework", "factory", "agent"), TOOLS, ids=[c[0] for c in TOOLS])
def test_tools_a_template_cannot_render_are_warned_about_once(
    backend, tmp_path, caplog, framework, factory, agent
) -> None:
    """SmolLM2's template has no tool syntax: say so once, naming the model and the agent."""
    spec = WorkflowSpec(
        factory=f"framework_programs:{factory}", framework=framework, agents=[agent]
    )
    caplog.set_level(logging.WARNING)
    with serve(backend, tmp_path) as served:
        runs = asyncio.run(
            run_tasks(
                spec,
                root_url=served.url,
                env_name="math",
                seeds=[0],
                branches=3,
                settings=SETTINGS,
                store=served.store,
            )
        )
        calls = list(served.store.calls())
    assert [r.error for r in runs] == [None] * 3
    assert len(calls) >= 3 and all(c.tools for c in calls)  # every call sent the tool
    warnings = [r.getMessage() for r in caplog.records if "sends tools" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"agent {agent!r} sends tools" in warnings[0]
    assert f"model {backend.model_names()[0]!r}" in warnings[0]
    assert "no tool-call syntax" in warnings[0]


def test_the_server_is_given_by_its_root_or_its_v1_url_and_checked_up_front(
    backend, tmp_path
) -> None:
    root = "http://127.0.0.1:8000"
    for url in (root, f"{root}/", f"{root}/v1", f"{root}/v1/"):
        assert server_root(url) == root
        assert rollout_url(url, "r1") == f"{root}/r/r1/v1"
    with pytest.raises(ValueError, match="one rollout's URL"):
        server_root(f"{root}/r/wf-0-0/v1")
    with pytest.raises(ValueError, match="must start with http"):
        server_root("127.0.0.1:8000")
    spec = WorkflowSpec(
        factory="framework_programs:langgraph_pair",
        framework="langgraph",
        agents=["solver", "checker"],
    )
    with serve(backend, tmp_path) as served:

        def run(url: str) -> list:
            return asyncio.run(
                run_tasks(
                    spec,
                    root_url=url,
                    env_name="math",
                    seeds=[0],
                    branches=1,
                    settings=SETTINGS,
                    store=served.store,
                )
            )

        (ran,) = run(f"{served.url}/v1")  # what `masenvs serve` prints
        assert ran.error is None and len(served.store.rollout(ran.rollout_id)) == 4
        with pytest.raises(ValueError, match="answered 404 on a rollout URL"):
            run(f"{served.url}/openai/v1")  # not a masenvs endpoint: refused before any run
    with pytest.raises(ConnectionError, match="cannot reach the masenvs server"):
        run(served.url)  # stopped


def test_masenvs_rollout_runs_your_factory_against_masenvs_serve(tmp_path, capsys) -> None:
    """The documented way: `masenvs serve`, then `masenvs rollout --workflow ... --url`
    with the URL exactly as the server printed it."""
    traces = tmp_path / "served"
    command = [sys.executable, "-m", "masenvs.adapters.serve", "--model", "tiny", "--port", "0"]
    command += ["--route", "solver=base", "--route", "checker=base"]  # other names: 404
    server = subprocess.Popen(
        [*command, "--traces", str(traces)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # "masenvs serve: tiny (embedded) at http://.../v1", after its loading line
        banner = next(line for line in server.stdout if " at http" in line)
        url = banner.split(" at ")[-1].strip()
        assert url.endswith("/v1"), banner
        code = rollout_main(
            [
                "--env",
                "math",
                "--set",
                "level=1",
                "--episodes",
                "2",
                "--branches",
                "2",
                "--max-tokens",
                "8",
                "--url",
                url,
                "--workflow",
                "framework_programs:langgraph_pair",
                "--framework",
                "langgraph",
                "--agents",
                "solver,checker",
            ]
        )
        out = capsys.readouterr().out
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=30)
    assert code == 0, out
    assert "4 runs of framework_programs:langgraph_pair" in out and "failed runs 0/4" in out
    store = TraceStore(traces)
    calls = list(store.calls())
    assert len(calls) == 4 * 4  # 4 runs, 2 calls of each of 2 agents, all recorded by serve
    assert {c.agent for c in calls} == {"solver", "checker"}
    assert len({c.rollout_id for c in calls}) == 4
    assert all(c.rollout_id.startswith("wf-") for c in calls)
