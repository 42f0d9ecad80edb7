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

    from masenvs.adapters.models import model_reference
    from masenvs.trainer.learner import Learner

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
