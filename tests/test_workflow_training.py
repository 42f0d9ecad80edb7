"""Training framework workflows (`masenvs train` with a `workflow:` section): the config,
unknown agents, failed runs, group keys and the checkpoints written, with the real
frameworks against the real endpoint and the tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from masenvs.adapters.frameworks import WorkflowSpec
from masenvs.traces import TraceStore
from masenvs.trainer.config import ConfigError, load_config

WORKFLOW = {
    "factory": "framework_programs:langgraph_pair",
    "framework": "langgraph",
    "agents": ["solver", "checker"],
}


def workflow_yaml(tmp_path: Path, **workflow: object) -> Path:
    path = tmp_path / "workflow.yaml"
    data = {"model": {"name": "tiny"}, "env": {"name": "math"}}
    data["workflow"] = {**WORKFLOW, **workflow}
    path.write_text(yaml.safe_dump(data))
    return path


def test_every_workflow_field_can_be_set_from_the_command_line(tmp_path: Path) -> None:
    cfg = load_config(
        workflow_yaml(tmp_path),
        ["workflow.timeout_s=8", "workflow.agents=[a, b]", "workflow.failure_reward=-2"],
    )
    assert cfg.workflow is not None
    assert (cfg.workflow.timeout_s, cfg.workflow.agents) == (8.0, ["a", "b"])
    assert cfg.workflow.failure_reward == -2.0
    # Each field, with a valid value, through --set (also on a config without the section).
    spec = WorkflowSpec(**WORKFLOW).model_dump(mode="json")
    for name, value in spec.items():
        override = f"workflow.{name}={yaml.safe_dump(value, default_flow_style=True).strip()}"
        cfg = load_config(workflow_yaml(tmp_path), [override])
        assert cfg.workflow is not None and getattr(cfg.workflow, name) == getattr(
            WorkflowSpec(**WORKFLOW), name
        ), override
    given = [f"workflow.{k}={v}" for k, v in WORKFLOW.items() if k != "agents"]
    cfg = load_config(None, [*given, "workflow.agents=[solver]", "workflow.timeout_s=8"])
    assert cfg.workflow is not None and cfg.workflow.timeout_s == 8.0
    with pytest.raises(ConfigError, match=r"workflow.timeot_s: unknown field \(did you mean"):
        load_config(workflow_yaml(tmp_path), ["workflow.timeot_s=8"])


def test_answer_from_with_llamaindex_is_refused_when_the_config_loads(tmp_path: Path) -> None:
    path = workflow_yaml(
        tmp_path, factory="framework_programs:llamaindex_pair", framework="llamaindex"
    )
    with pytest.raises(ConfigError, match="answer_from is not supported with framework 'llama"):
        load_config(path, ["workflow.answer_from=answer"])
    assert load_config(path).workflow.answer_from is None  # type: ignore[union-attr]
    langgraph = load_config(workflow_yaml(tmp_path, answer_from="answer"))
    assert langgraph.workflow is not None and langgraph.workflow.answer_from == "answer"


def test_adapters_name_their_real_base_so_peft_loads_them_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loader: Any
) -> None:
    from peft import AutoPeftModelForCausalLM

    from masenvs.engine.loading import model_reference
    from masenvs.trainer.learner.learner import Learner

    cfg = load_config(None, ["model.name=tiny", "lora.rank=4", "lora.alpha=8"])
    learner = Learner(cfg, ["solver"], loader)
    with torch.no_grad():  # non-zero B, so the adapter changes the outputs
        for p in learner.policies["solver"].params:
            p.add_(0.05)
    saved = learner.save_adapter("solver", tmp_path / "adapter")
    config = json.loads((saved / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]).is_absolute()
    assert (Path(config["base_model_name_or_path"]) / "config.json").is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # what `vllm serve --lora-modules` / peft do on another box
    model = AutoPeftModelForCausalLM.from_pretrained(str(saved)).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        want = learner.policies["solver"].model(input_ids=ids).logits
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Model directories are written as absolute paths, hub ids as they are.
    (elsewhere / "mine").mkdir()
    assert model_reference("mine") == str(elsewhere.resolve() / "mine")
    assert model_reference("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"


# -- training runs --------------------------------------------------------------------------


def train_config(tmp_path: Path, *overrides: str) -> Any:
    """One training step of a workflow on math: 1 task x 2 runs, short completions."""
    return load_config(None, train_overrides(tmp_path, *overrides))


def train_overrides(tmp_path: Path, *overrides: str) -> list[str]:
    return [
        f"run_dir={tmp_path / 'run'}",
        "model.name=tiny",
        "lora.rank=4",
        "lora.alpha=8",
        "steps=1",
        "env.name=math",
        "env.options={level: 1}",
        "rollout.branches=2",
        "rollout.tasks_per_step=1",
        "rollout.max_tokens=8",
        "validation.every=0",
        "logging.tensorboard=false",
        "logging.plot_every=0",
        *overrides,
    ]


def workflow(factory: str, framework: str, agents: list[str], **more: object) -> list[str]:
    out = [
        f"workflow.factory={factory}",
        f"workflow.framework={framework}",
        f"workflow.agents=[{', '.join(agents)}]",
    ]
    return out + [f"workflow.{k}={v}" for k, v in more.items()]


def last_metrics(run_dir: Path) -> dict[str, Any]:
    from masenvs.trainer.run.metrics import read_metrics

    return read_metrics(run_dir / "metrics.jsonl")[-1]


def test_an_unknown_model_name_stops_training_with_its_name(tmp_path: Path) -> None:
    from masenvs.trainer.rollout.workflow import UnknownAgentError
    from masenvs.trainer.run.train import train

    cfg = train_config(
        tmp_path, *workflow("workflow_programs:langgraph_own_critic", "langgraph", ["solver"])
    )
    with pytest.raises(UnknownAgentError) as err:
        train(cfg)
    message = str(err.value)
    assert "'critic_v2'" in message and "(solver)" in message
    assert "workflow.unknown_agents" in message
    assert not (tmp_path / "run" / "checkpoints").exists()  # no update, no checkpoint
    # The run that made the call failed with the endpoint's answer, which names the fix too.
    (episode, *_) = TraceStore(tmp_path / "run" / "traces").episodes()
    assert "critic_v2" in episode.extra["error"] and "404" in episode.extra["error"]


@pytest.mark.parametrize("mode", ["per_agent", "shared"])
def test_unknown_agents_base_are_served_by_the_base_model_and_never_trained(
    tmp_path: Path, mode: str
) -> None:
    """An AutoGen SelectorGroupChat whose selector is not an agent: the base model picks."""
    from masenvs.trainer.run.train import train

    agents = ["coder", "reviewer"]
    cfg = train_config(
        tmp_path,
        "env.name=code",
        "env.options={}",
        f"policy.mode={mode}",
        *workflow("framework_programs:autogen_selector", "autogen", agents, unknown_agents="base"),
    )
    train(cfg)
    calls = list(TraceStore(tmp_path / "run" / "traces").calls())
    selector = [c for c in calls if c.agent == "selector"]
    assert selector and {c.model for c in selector} == {"base"}
    by_agent = {a: sum(c.agent == a for c in calls) for a in agents}
    metrics = last_metrics(tmp_path / "run")
    if mode == "shared":  # only the agents' calls train the shared adapter
        assert metrics["learner/shared/samples"] == sum(by_agent.values())
    else:
        for agent in agents:
            if by_agent[agent]:
                assert metrics[f"learner/{agent}/samples"] == by_agent[agent]
        assert not any(k.startswith("learner/selector/") for k in metrics)


def test_a_mapped_name_is_served_and_trained_as_its_agent(tmp_path: Path) -> None:
    from masenvs.trainer.run.train import train

    cfg = train_config(
        tmp_path,
        *workflow(
            "workflow_programs:llamaindex_mapped_critic",
            "llamaindex",
            ["drafter", "critic"],
            unknown_agents="map",
            agent_map="{critic_v2: critic}",
        ),
    )
    train(cfg)
    calls = list(TraceStore(tmp_path / "run" / "traces").calls())
    assert {c.agent for c in calls} == {"drafter", "critic", "critic_v2"}
    assert {c.model for c in calls if c.agent == "critic_v2"} == {"critic"}  # its adapter
    metrics = last_metrics(tmp_path / "run")
    assert metrics["learner/critic/samples"] == 4  # 2 runs x (critic + critic_v2)
    assert metrics["learner/drafter/samples"] == 2
    # The checkpoint's adapters name the real base model, not "tiny".
    (config_file,) = (tmp_path / "run" / "checkpoints").glob(
        "*/adapters/critic/adapter_config.json"
    )
    base = json.loads(config_file.read_text())["base_model_name_or_path"]
    assert Path(base).is_absolute() and (Path(base) / "config.json").is_file()


def test_unknown_agent_settings_are_checked_when_the_config_loads(tmp_path: Path) -> None:
    path = workflow_yaml(tmp_path)
    with pytest.raises(ConfigError, match="unknown_agents 'map' needs agent_map"):
        load_config(path, ["workflow.unknown_agents=map"])
    with pytest.raises(ConfigError, match="set unknown_agents: map"):
        load_config(path, ["workflow.agent_map={critic_v2: checker}"])
    with pytest.raises(ConfigError, match="not one of agents"):
        load_config(path, ["workflow.unknown_agents=map", "workflow.agent_map={x: critic}"])


FAILING = [
    ("langgraph", "workflow_programs:langgraph_fails", ["solver"], "ValueError: no answer"),
    ("autogen", "workflow_programs:autogen_fails", ["coder"], "sandbox unavailable"),
    ("llamaindex", "workflow_programs:llamaindex_fails", ["drafter"], "citation index"),
]


@pytest.mark.parametrize(
    ("framework", "factory", "agents", "reason"), FAILING, ids=[c[0] for c in FAILING]
)
def test_a_run_that_keeps_failing_stops_with_the_most_common_reason(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    framework: str,
    factory: str,
    agents: list[str],
    reason: str,
) -> None:
    from masenvs.trainer.commands.train import main

    (tmp_path / "empty.yaml").write_text("{}\n")
    overrides = train_overrides(tmp_path, *workflow(factory, framework, agents), "steps=3")
    overrides += ["workflow.max_failure_rate=0.5", "workflow.failure_window=4"]
    code = main([str(tmp_path / "empty.yaml"), *(f"--set={o}" for o in overrides)])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert code == 1, out
    assert "2 of the last 2 workflow runs failed" in out and reason in out
    assert "(2 runs)" in out  # the most common reason, counted
    assert "nan" not in out.lower()
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before the update


def test_runs_past_their_timeout_stop_once_with_the_key_to_raise_and_their_call_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from masenvs.trainer.commands.train import main

    (tmp_path / "empty.yaml").write_text("{}\n")
    overrides = train_overrides(
        tmp_path,
        # 10 s: time for the one call on a loaded 2-core machine (at 2 s it missed in a CI run)
        *workflow("framework_programs:calls_then_sleeps", "langgraph", ["solver"], timeout_s=10),
        "steps=3",
        "workflow.max_failure_rate=0.5",
        "workflow.failure_window=4",
    )
    code = main([str(tmp_path / "empty.yaml"), *(f"--set={o}" for o in overrides)])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert code == 1, out
    assert out.count("stopping:") == 1 and out.count("raise workflow.timeout_s") == 1, out
    # The fix, sized by what the runs measured: each made one call before its deadline.
    assert "ran past timeout_s=10; their 2 finished LLM calls took" in out, out
    assert "lower rollout.max_tokens" in out


def test_a_step_without_trainable_samples_says_why_and_does_not_update(tmp_path: Path) -> None:
    from io import StringIO

    from rich.console import Console

    from masenvs.trainer.run.train import train

    factory = "workflow_programs:langgraph_fails_at_once"
    cfg = train_config(
        tmp_path,
        *workflow(factory, "langgraph", ["solver", "checker"], max_failure_rate=1.0),
        "steps=2",
    )
    printed = StringIO()
    train(cfg, console=Console(file=printed, width=200))
    out = printed.getvalue()
    assert out.count("no trainable sample, no update: all 2 runs failed") == 2, out
    assert "FileNotFoundError: prompts.yaml" in out
    assert "solver -  checker -" in out  # no reward to show, and no NaN either
    assert "nan" not in out.lower()
    raw = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in raw and "learner/" not in raw  # no update was made


# -- group keys: named steps ---------------------------------------------------------------

STEPS = [
    ("langgraph", "workflow_programs:langgraph_steps", ["solver", "critic"]),
    ("autogen", "workflow_programs:autogen_steps", ["coder", "critic"]),
    ("llamaindex", "workflow_programs:llamaindex_steps", ["drafter", "critic"]),
]


@pytest.fixture(scope="module")
def backend() -> Any:
    from framework_support import random_lora

    from masenvs.engine.engine import EmbeddedBackend

    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=16, max_model_len=1024)
    for seed, name in enumerate(("lora_a", "lora_b"), start=1):
        random_lora(engine, name, seed)
    yield engine
    engine.shutdown()


@pytest.mark.parametrize(("framework", "factory", "agents"), STEPS, ids=[s[0] for s in STEPS])
def test_named_steps_group_like_decisions_together(
    backend: Any, tmp_path: Path, framework: str, factory: str, agents: list[str]
) -> None:
    """Run 0 critiques once, run 1 twice, then each gives a verdict: by call index the
    verdict of run 0 would share a group with the second critique of run 1."""
    import asyncio
    from collections import defaultdict

    from framework_support import serve

    from masenvs.adapters.frameworks import ClientSettings
    from masenvs.adapters.policy import Sampling
    from masenvs.trainer.rollout.workflow import collect_workflow_samples

    routes = dict(zip(agents, ("lora_a", "lora_b")))
    spec = WorkflowSpec(factory=factory, framework=framework, agents=agents)
    with serve(backend, tmp_path / "traces", policy_map=routes) as served:
        samples, runs = asyncio.run(
            collect_workflow_samples(
                spec,
                root_url=served.url,
                store=served.store,
                env_name="math",
                seeds=[0],
                branches=2,
                settings=ClientSettings(sampling=Sampling(max_tokens=6)),
                policy_of=lambda agent: agent,
            )
        )
        calls = list(served.store.calls())
    assert [r.error for r in runs] == [None, None]
    critic = [c for c in calls if c.agent == "critic"]
    assert {c.model for c in critic} == {"lora_b"}  # the agent part picks the policy
    steps = sorted((c.rollout_id, c.step, c.call_index) for c in critic)
    assert steps == [
        ("s0-0-0", "critique", 0),
        ("s0-0-0", "verdict", 0),
        ("s0-0-1", "critique", 0),
        ("s0-0-1", "critique", 1),
        ("s0-0-1", "verdict", 0),
    ]
    groups: dict[tuple, list[str]] = defaultdict(list)
    for s in samples:
        if s.agent == "critic":
            groups[s.group].append(s.meta["rollout_id"])
    assert groups == {
        ("math:0", "critic", "critique", 0): ["s0-0-0", "s0-0-1"],
        ("math:0", "critic", "critique", 1): ["s0-0-1"],
        ("math:0", "critic", "verdict", 0): ["s0-0-0", "s0-0-1"],
    }
    assert all(s.policy == "critic" for s in samples if s.agent == "critic")


def test_a_client_asked_for_an_undeclared_agent_stops_training_too(tmp_path: Path) -> None:
    """The AutoGen selector's client taken from ctx.clients, the selector not an agent."""
    from masenvs.trainer.rollout.workflow import UnknownAgentError
    from masenvs.trainer.run.train import train

    cfg = train_config(
        tmp_path,
        "env.name=code",
        "env.options={}",
        *workflow("framework_programs:autogen_selector", "autogen", ["coder", "reviewer"]),
    )
    with pytest.raises(UnknownAgentError, match=r"agent 'selector' is not one of .*unknown_agents"):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


# -- the learner scores each sample at the parameters it was sampled with ---------------------


def test_a_program_sampling_at_its_own_temperature_is_scored_at_it(
    tmp_path: Path, loader: Any
) -> None:
    """The program's solver samples at 0.2 under rollout.temperature 1.0 (its checker at the
    run's): before any update the learner's log-probs of each sample are those of the
    distribution the engine sampled it from, the solver's and the checker's in one batch."""
    import asyncio

    from framework_support import serve

    from masenvs.adapters.frameworks import ClientSettings
    from masenvs.adapters.policy import Sampling
    from masenvs.engine.engine import EmbeddedBackend
    from masenvs.trainer.learner.learner import Learner
    from masenvs.trainer.rollout.workflow import collect_workflow_samples

    cfg = load_config(
        None, ["model.name=tiny", "model.device=cpu", "lora.rank=4", "policy.mode=shared"]
    )
    assert cfg.rollout.temperature == 1.0
    learner = Learner(cfg, ["solver", "checker"], loader)  # LoRA B = 0: the base model
    engine = EmbeddedBackend.from_spec("tiny", max_batch_size=4, dtype="float32", quantize="none")
    spec = WorkflowSpec(
        factory="workflow_programs:langgraph_cold_solver",
        framework="langgraph",
        agents=["solver", "checker"],
    )
    sampling = Sampling(temperature=cfg.rollout.temperature, max_tokens=8)
    try:
        with serve(engine, tmp_path / "traces") as s:
            samples, _ = asyncio.run(
                collect_workflow_samples(
                    spec,
                    root_url=s.url,
                    store=s.store,
                    env_name="math",
                    env_options={"level": 1},
                    seeds=[3],
                    branches=2,
                    settings=ClientSettings(sampling=sampling),
                    endpoint=s.endpoint,
                    policy_of=cfg.policy.policy_of,
                )
            )
    finally:
        engine.shutdown()
    temperatures = {"solver": 0.2, "checker": 1.0}
    assert {s.agent for s in samples} == set(temperatures) and len(samples) == 4
    for s in samples:  # the Sample keeps what the trace recorded of the call
        assert s.sampling is not None and s.sampling.temperature == temperatures[s.agent]

    model = learner.policies["shared"].model
    scored = learner.logprobs("shared", samples)  # one micro-batch, two temperatures
    for s, got in zip(samples, scored, strict=True):
        ids = torch.tensor([s.prompt_token_ids + s.completion_token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(s.prompt_token_ids) - 1 : -1].float()
        tokens = torch.tensor(s.completion_token_ids)[:, None]
        # Same weights as the engine: the raw (T=1) log-probs are the ones it reported ...
        raw = torch.log_softmax(logits, -1).gather(1, tokens)[:, 0]
        torch.testing.assert_close(raw, torch.tensor(s.behavior_logprobs), atol=1e-4, rtol=0)
        # ... and the learner scores the distribution the token was drawn from.
        sampled = torch.log_softmax(logits / temperatures[s.agent], -1).gather(1, tokens)[:, 0]
        torch.testing.assert_close(got, sampled, atol=1e-5, rtol=1e-5)
