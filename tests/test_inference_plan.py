"""The run's inference, planned from the config alone: which backend, which served models
and which policies each answers for, which servers to start or reach, what each agent's
requests ask for. Pure: no model loads, no process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from masenvs.adapters.stack import StackError
from masenvs.engine.args import EngineArgs
from masenvs.trainer.config import load_config
from masenvs.trainer.inference.plan import InferencePlan, ServedModel, inference_plan
from masenvs.trainer.run.train import run_agents

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def plan_of(path: str | None, *overrides: str, agents: list[str] | None = None) -> InferencePlan:
    cfg = load_config(EXAMPLES / path if path else None, list(overrides))
    return inference_plan(cfg, agents or run_agents(cfg), "cpu")


def test_the_quickstart_serves_both_adapters_from_one_engine_in_this_process() -> None:
    plan = plan_of("quickstart.yaml")
    assert plan.kind == "embedded" and not plan.full
    assert plan.served == (ServedModel("smollm2-135m", ["tool", "plan"]),)
    assert (plan.in_place, plan.routed, plan.pooled) == (True, False, False)
    assert plan.models == {"tool": "tool", "plan": "plan"}  # each agent asks for its adapter
    # The engine: the YAML's backend section on the learner's device, EngineArgs elsewhere.
    assert plan.engine == EngineArgs(device="cpu", batch_invariant="auto")
    assert plan.lora_rank == 8


def test_a_shared_policy_is_one_adapter_every_agent_asks_for() -> None:
    plan = plan_of("quickstart.yaml", "policy.mode=shared")
    assert plan.served == (ServedModel("smollm2-135m", ["shared"]),)
    assert plan.models == {"tool": "shared", "plan": "shared"}


def test_a_full_finetune_on_one_vllm_server_asks_for_its_base_model() -> None:
    """The paper's shared full model (math, Qwen3-1.7B): one server started here holds the
    policy's weights, so requests ask for its base model; weights reach it as files."""
    plan = plan_of("paper/math_qwen3_1.7b.yaml", agents=["reasoner", "tool"])
    assert plan.kind == "vllm" and plan.full
    (served,) = plan.served
    assert served.policies == ["shared"] and served.trained and served.url is None
    assert (plan.in_place, plan.routed) == (False, False)
    assert plan.models == {"reasoner": "base", "tool": "base"}
    assert plan.vllm_args == ("--gpu-memory-utilization", "0.3", "--max-model-len", "12288")


def test_full_models_per_agent_get_a_server_each_behind_a_router() -> None:
    plan = plan_of(
        "paper/math_qwen3_1.7b.yaml", "policy.mode=per_agent", agents=["reasoner", "tool"]
    )
    assert [(s.policies, s.trained) for s in plan.served] == [
        (["reasoner"], True),
        (["tool"], True),
    ]
    assert plan.routed and plan.models == {"reasoner": "reasoner", "tool": "tool"}


def test_full_weights_in_this_process_are_routed_by_policy_name() -> None:
    """The embedded engine knows a fully fine-tuned policy only as its base model: a router
    in front maps the policy's name to it, and a frozen agent keeps the base's engine."""
    plan = plan_of(
        None,
        "model.name=tiny",
        "policy.finetune=full",
        "agents={critic: {freeze: true}}",
        agents=["plan", "tool", "critic"],
    )
    assert [(s.policies, s.trained) for s in plan.served] == [
        (["plan"], True),
        (["tool"], True),
        (["critic"], False),
    ]
    assert plan.in_place and plan.routed
    assert plan.models == {"plan": "plan", "tool": "tool", "critic": "critic"}


def test_separate_bases_are_served_one_engine_per_base() -> None:
    plan = plan_of(
        None,
        "model.name=tiny",
        "policy.mode=separate",
        "policy.models={tool: /models/other}",
        agents=["plan", "tool", "critic"],
    )
    assert plan.served == (
        ServedModel("tiny", ["plan", "critic"]),
        ServedModel("/models/other", ["tool"]),
    )
    assert plan.routed and plan.models["critic"] == "critic"


def test_the_distributed_example_pools_vllm_replicas_of_one_served_model() -> None:
    plan = plan_of("distributed.yaml", "distributed.engines.count=2")
    assert plan.kind == "vllm" and plan.pooled and not plan.in_place
    assert plan.served == (ServedModel("Qwen/Qwen3-8B", ["tool", "plan"]),)
    assert plan.engines.count == 2 and not plan.routed
    assert plan.models == {"tool": "tool", "plan": "plan"}


def test_pooled_embedded_engines_take_full_weights_as_files() -> None:
    plan = plan_of(
        "quickstart.yaml",
        "policy.mode=shared",
        "policy.finetune=full",
        "distributed.engines.count=2",
    )
    assert plan.kind == "embedded" and plan.pooled and not plan.in_place
    assert plan.models == {"tool": "base", "plan": "base"}  # one pool holds the weights


def test_running_servers_given_by_url() -> None:
    plan = plan_of("distributed.yaml", "backend.vllm_url=http://node-1:8000")
    assert [s.url for s in plan.served] == ["http://node-1:8000"]
    replicas = plan_of("distributed.yaml", "distributed.engines.urls=[http://a:1, http://b:2]")
    assert replicas.pooled and replicas.engines.urls == ["http://a:1", "http://b:2"]


def test_servers_that_do_not_fit_the_policies_fail_before_anything_loads() -> None:
    with pytest.raises(StackError, match="both say where the engines are"):
        plan_of("distributed.yaml", "backend.vllm_url=http://h:1", "distributed.engines.count=2")
    with pytest.raises(StackError, match="urls lists replicas of one served model"):
        plan_of("quickstart.yaml", "policy.finetune=full", "distributed.engines.urls=[http://h:1]")
    with pytest.raises(StackError, match=r"names one vLLM server, but these policies need 2"):
        plan_of(
            "paper/math_qwen3_1.7b.yaml",
            "policy.mode=per_agent",
            "backend.vllm_url=http://h:1",
            agents=["reasoner", "tool"],
        )


def test_training_stops_on_a_misfit_before_the_learner_loads(tmp_path, monkeypatch) -> None:
    from rich.console import Console

    from masenvs.trainer.run import train as train_module

    monkeypatch.setattr(train_module, "make_learner", lambda *_: pytest.fail("a model loaded"))
    cfg = load_config(
        EXAMPLES / "quickstart.yaml",
        [f"run_dir={tmp_path}", "backend.vllm_url=http://h:1", "distributed.engines.count=2"],
    )
    with pytest.raises(StackError, match="both say where the engines are"):
        train_module.train(cfg, console=Console(quiet=True))
