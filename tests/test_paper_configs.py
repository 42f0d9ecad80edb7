"""The paper configs (examples/paper/): each loads as written and trains 2 steps on CPU.

Every config trains once here, in the rehearsal a GPU machine runs (`scripts/check_train_gpu.py
--config all`) with the tiny model, the embedded engine and small sizes; everything else
(policy mode, full or LoRA, filters, sampling, chat template variables) stays as the config
has it, and each run's metrics and checkpoint are checked.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors import safe_open

import masenvs
import masenvs.trainer.run.train as train_module
from masenvs.trainer.config import TrainConfig, load_config
from masenvs.trainer.run.train import train

ROOT = Path(__file__).resolve().parents[1]
PAPER = ROOT / "examples" / "paper"
SCRIPT = ROOT / "scripts" / "check_train_gpu.py"
DOCS = (ROOT / "docs" / "paper.md").read_text()
# Stronger-MAS configs of the MAS rows; the auto-MAS one's settings are checked in
# tests/test_auto_mas.py, the single-agent baseline's against its MAS config below.
SINGLE_AGENT = PAPER / "plan_path_single_agent_grpo.yaml"
CONFIGS = sorted(
    p for p in PAPER.glob("*.yaml") if not p.stem.startswith("auto_mas") and p != SINGLE_AGENT
)
ALL = sorted(PAPER.glob("*.yaml"))  # the rehearsal trains every one, auto-MAS's too
TASKS = ("plan_path", "sudoku", "sokoban", "math", "code")
MODELS = {"qwen3_1.7b": "Qwen/Qwen3-1.7B", "qwen3_8b": "Qwen/Qwen3-8B"}
IDS = [p.stem for p in CONFIGS]

# Datasets the math and code configs train on need the Hub; tests use the built-in tasks.
OFFLINE_TASKS = {
    "math": ["env.options.source=generated"],
    "code": ["env.options.source=builtin", "env.options.split=null"],
}


def tiny_overrides(config: TrainConfig, run_dir: Path) -> list[str]:
    """The `--set` overrides that make a paper config a 2-step CPU run."""
    overrides = [
        "model.name=tiny",
        "model.device=cpu",
        "model.dtype=auto",
        "backend.kind=embedded",
        "steps=2",
        "rollout.tasks_per_step=1",
        "rollout.branches=2",
        "rollout.max_tokens=8",
        "rollout.max_rounds=1",
        "rollout.concurrency=2",
        "validation.episodes=1",
        "logging.tensorboard=false",
        "logging.plot_every=0",
        f"run_dir={run_dir}",
    ]
    return overrides + OFFLINE_TASKS.get(config.env.name, [])


def roles(config: TrainConfig) -> list[str]:
    return list(masenvs.env_class(config.env.name).roles)


def test_every_task_has_both_models() -> None:
    assert sorted(IDS) == sorted(f"{t}_{m}" for t in TASKS for m in MODELS)


@pytest.mark.parametrize("path", CONFIGS, ids=IDS)
def test_paper_config_as_written(path: Path) -> None:
    config = load_config(path)
    model = next(name for key, name in MODELS.items() if path.stem.endswith(key))
    assert config.model.name == model
    assert config.env.name == path.stem.rsplit("_qwen3", 1)[0]
    # An `agents` entry under a wrong role name would be ignored silently.
    assert sorted(config.agents) == sorted(roles(config))
    for role in roles(config):
        assert config.agents[role].chat_template_kwargs == {"enable_thinking": False}, role
    assert config.backend.kind == "vllm" and config.backend.vllm_url is None
    args = config.backend.vllm_args
    assert 0 < float(args[args.index("--gpu-memory-utilization") + 1]) < 0.5  # learner shares GPU
    assert int(args[args.index("--max-model-len") + 1]) >= config.rollout.max_tokens + 4096
    assert config.policy.finetune == ("full" if "1.7b" in path.stem else "lora")


# What the authors' configs set per policy form (shared 1.7B vs per-role LoRA 8B): the
# planning temperature (1.5 vs 1.0) and math's answer length (4096 vs 8192); docs/paper.md.
PER_FORM = {"temperature", "max_tokens"}


@pytest.mark.parametrize("task", TASKS)
def test_both_models_run_the_same_experiment(task: str) -> None:
    small, large = (load_config(PAPER / f"{task}_{m}.yaml") for m in MODELS)
    for section in ("env", "validation", "agents"):
        assert getattr(small, section) == getattr(large, section), section
    assert small.rollout.model_dump(exclude=PER_FORM) == large.rollout.model_dump(exclude=PER_FORM)


def test_single_agent_baseline_as_docs_paper_runs_it(tmp_path: Path) -> None:
    # docs/paper.md: the "single agent + GRPO" row is the MAS config with one role left.
    path = PAPER / "plan_path_qwen3_8b.yaml"
    single = [
        "env.options.single_agent=true",
        "agents={plan: {chat_template_kwargs: {enable_thinking: false}}}",
    ]
    assert all(f"--set {o}" in DOCS or f"--set '{o}'" in DOCS for o in single)
    config = load_config(path, tiny_overrides(load_config(path), tmp_path / "run") + single)
    result = train(config)
    checkpoint = result.run_dir / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in (checkpoint / "adapters").iterdir()) == ["plan"]


def test_single_agent_grpo_is_the_mas_config_with_one_role_in_a_tree() -> None:
    # The ref's single-agent "GRPO" runs (stateful_L0_single_agent.yaml) are tree sampling
    # with the plan agent alone, at its L0 temperatures; all else is the MAS config's.
    single, mas = load_config(SINGLE_AGENT), load_config(PAPER / "plan_path_qwen3_1.7b.yaml")
    assert single.env.options == {**mas.env.options, "single_agent": True}
    assert single.rollout.mode == "tree" and single.rollout.group_by == "turn_agent"
    assert (single.rollout.temperature, single.validation.temperature) == (1.0, 0.6)
    assert single.rollout.model_copy(update={"temperature": mas.rollout.temperature}) == mas.rollout
    temperature = {"temperature": mas.validation.temperature}
    assert single.validation.model_copy(update=temperature) == mas.validation
    assert single.agents == {"plan": mas.agents["plan"]}
    for section in ("model", "algorithm", "optim", "policy", "lora", "backend", "steps"):
        assert getattr(single, section) == getattr(mas, section), section
    assert single.run_dir != mas.run_dir


def check_train_gpu() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_train_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_check_needs_a_local_model_when_the_hub_is_out_of_reach(tmp_path: Path) -> None:
    # No --model, and the config's hub id is in no local cache: the error names the fix.
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 2
    assert "Qwen/Qwen3-1.7B" in done.stderr and "--model" in done.stderr


def test_gpu_check_stops_before_using_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    script = check_train_gpu()
    assert script.main(["--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert script.main(["--model", "tiny", "--set", "rollout.brnches=2"]) == 2
    assert "did you mean 'branches'" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert script.main(["--model", "tiny"]) == 2  # a valid run, but no GPU
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_check_rehearsal_on_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The whole check on CPU with a random model of Qwen3's vocabulary, the way a lent GPU
    # machine without weights runs it (--random-init), only smaller.
    script = check_train_gpu()
    small = dict(script.QWEN3_SHAPES["qwen3-1.7b"], hidden_size=64, intermediate_size=128)
    small.update(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    monkeypatch.setitem(script.QWEN3_SHAPES, "qwen3-1.7b", small)
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = "--device cpu --random-init qwen3-1.7b --backend embedded --steps 2 --tasks 1"
    argv += " --max-tokens 8 --rounds 1 --set rollout.branches=2"
    assert script.main(argv.split()) == 0
    result = json.loads((tmp_path / "check_train_gpu.json").read_text())
    assert [s["step"] for s in result["steps"]] == [1, 2]
    updated = [s for s in result["steps"] if s["update_s"] == s["update_s"]]  # not NaN
    assert updated and all(s["mfu"] > 0 and s["learner_tokens_per_s"] > 0 for s in updated)
    assert result["settings"]["finetune"] == "full"  # the default config, as written
    printed = capsys.readouterr().out
    assert "MFU" in printed and "peak memory" in printed
    assert not list(Path(tempfile.gettempdir()).glob(f"check-train-gpu-{os.getpid()}*"))


@dataclass
class Run:
    """One paper config's run in the rehearsal, looked at before the script removes it."""

    config: TrainConfig
    rows: list[dict]
    checkpoint_step: int
    saved: TrainConfig
    adapters: list[str]  # policies with an adapter_model.safetensors
    stored_params: int  # in the checkpoint's safetensors, adapters or whole models


@dataclass
class Rehearsal:
    code: int
    out: Path
    runs: dict[str, Run]
    printed: str


def look_at(config: TrainConfig, run_dir: Path) -> Run:
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    stored = 0
    for file in checkpoint.rglob("*.safetensors"):
        with safe_open(file, "pt") as weights:
            names = weights.keys()
            stored += sum(math.prod(weights.get_slice(n).get_shape()) for n in names)
    adapters = checkpoint / "adapters"
    return Run(
        config=config,
        rows=[json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()],
        checkpoint_step=json.loads((checkpoint / "state.json").read_text())["step"],
        saved=load_config(checkpoint / "config.yaml"),
        adapters=sorted(
            p.name for p in adapters.glob("*") if (p / "adapter_model.safetensors").is_file()
        ),
        stored_params=stored,
    )


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> Rehearsal:
    """`--config all` as a GPU machine runs it, here on CPU with the tiny model for 2 steps: the
    one run of every paper config in the suite. Each run is looked at (metrics, checkpoint)
    when train() returns, before the script removes its run dir."""
    script = check_train_gpu()
    out = tmp_path_factory.mktemp("rehearsal")
    argv = "--config all --device cpu --model tiny --backend embedded --steps 2 --tasks 1"
    argv += " --max-tokens 8 --rounds 1 --offline-tasks --set rollout.branches=2"
    argv += " --set rollout.concurrency=2 --set validation.every=2 --set validation.episodes=1"
    runs: dict[str, Run] = {}
    current: list[str] = []
    check, real_train = script.check, train_module.train

    def check_one(args: Any, out_dir: Path) -> int:
        current[:] = [Path(args.config).stem]
        return check(args, out_dir)

    def train_and_look(config: TrainConfig) -> Any:
        result = real_train(config)
        runs[current[0]] = look_at(config, result.run_dir)
        return result

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("OUT", str(out))
        patch.setattr(script, "check", check_one)
        patch.setattr(train_module, "train", train_and_look)
        code = script.main(argv.split())
    return Rehearsal(code, out, runs, printed.getvalue())


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_paper_config_trains_two_tiny_steps(path: Path, rehearsal: Rehearsal) -> None:
    written = load_config(path)
    run = rehearsal.runs[path.stem]
    config = run.config
    assert config.policy == written.policy and config.algorithm == written.algorithm

    trained = [r for r in run.rows if "time/update_s" in r]
    assert [r["step"] for r in trained] == [1, 2]
    assert all("train/success" in r and "groups/groups" in r for r in trained)
    assert [r["step"] for r in run.rows if "val/success" in r] == [0, 2]

    assert run.checkpoint_step == 2
    assert run.saved.policy.finetune == written.policy.finetune
    policies = config.policy.policies(roles(config))
    if written.policy.finetune == "lora":
        assert run.adapters == sorted(policies)
    else:
        # Full fine-tuning saves whole models, one per policy, not adapters.
        from masenvs.engine.loading import load_model

        model_params = sum(p.numel() for p in load_model("tiny").model.parameters())
        assert not run.adapters
        assert run.stored_params >= model_params * len(policies)


def test_gpu_rehearsal_runs_every_paper_config_on_cpu(rehearsal: Rehearsal) -> None:
    # `--config all` is what a GPU machine runs to rehearse every paper config; here the
    # same script, the same per-config overrides and train(), with the tiny model on CPU.
    assert rehearsal.code == 0, rehearsal.printed[-3000:]
    rows = json.loads((rehearsal.out / "check_train_gpu_all.json").read_text())
    assert [r["config"] for r in rows] == [p.name for p in ALL]
    assert all(r["ok"] and r["error"] is None and r["rollout_s"] > 0 for r in rows), rows
    for path in ALL:
        one = json.loads((rehearsal.out / path.stem / "check_train_gpu.json").read_text())
        written = load_config(path)
        # The config's method as written: policy mode, fine-tuning, K from --set only.
        assert one["settings"]["mode"] == written.policy.mode
        assert one["settings"]["finetune"] == written.policy.finetune
        assert [s["step"] for s in one["steps"]] == [1, 2]
    table = rehearsal.printed.rsplit("error\n", 1)[1].splitlines()[: len(rows)]
    assert all(line.split()[1] == "yes" for line in table), table
