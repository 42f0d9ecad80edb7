"""scripts/cold_start_then_rl.py --smoke: solver demonstrations -> sft -> greedy eval -> AT-GRPO
from the SFT checkpoint -> eval, and the SFT-continued control, end to end on the tiny model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cold_start_then_rl.py"


def load_script():
    spec = importlib.util.spec_from_file_location("cold_start_then_rl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lora_b(run: Path, step: int, policy: str) -> list:
    path = run / "checkpoints" / f"step_{step:08d}" / "adapters" / policy
    tensors = load_file(str(path / "adapter_model.safetensors"))
    return [v for k, v in tensors.items() if "lora_B" in k]


def pipeline(tmp_path: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_smoke_pipeline_runs_every_step_from_demos_to_rl(tmp_path: Path) -> None:
    out = tmp_path / "cold"
    said = pipeline(tmp_path, "--out", str(out), "--wrong-proposals", "0.5")
    # each step as the command a user types, in order
    steps = ["$ masenvs demos", "$ masenvs sft", "$ masenvs eval", "$ masenvs train", "--resume"]
    assert "--explain --wrong-proposals 0.5" in said
    at = [said.find(s) for s in steps]
    assert -1 not in at and at[:4] == sorted(at[:4]), said

    rows = [json.loads(line) for line in (out / "demos.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and {r["agent"] for r in rows} == {"tool", "plan"}
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["greedy_success"]) == {"sft", "rl", "sft_continued", "rl_from_base"}
    assert summary["sft_epochs"]["sft_continued"] > summary["sft_epochs"]["sft"]

    # sft read the 4 demonstrations and trained both agents' adapters (B starts at zero) ...
    rl = out / "rl"
    for policy in ("tool", "plan"):
        assert all(float(b.abs().max()) > 0 for b in lora_b(out / "sft", 0, policy))
        assert all(
            bool((a == b).all())
            for a, b in zip(lora_b(out / "sft", 0, policy), lora_b(rl, 0, policy))
        )
    # ... and RL continued from them: step 1 of the same run, resumed from checkpoint 0
    assert "resumed from" in said and (rl / "checkpoints" / "step_00000001").is_dir()
    # with no KL penalty pulling the SFT weights back toward the base model
    assert "KL penalty's reference is the base model" not in " ".join(said.split())
    state = json.loads((rl / "checkpoints" / "step_00000000" / "state.json").read_text())
    assert state["extra"]["sft"]["epochs"] == 1

    # every eval is greedy, on the validation seeds, none of them a demonstration's
    demo_seeds = {r["seed"] for r in rows}
    base = out / "rl_from_base" / "checkpoints"
    assert sorted(p.name for p in base.glob("step_*")) == ["step_00000001"]  # no SFT step 0
    for name in ("eval_sft", "eval_rl", "eval_sft_continued", "eval_rl_from_base"):
        report = json.loads((out / f"{name}.json").read_text())
        assert report["sampling"]["temperature"] == 0.0 and len(report["tasks"]) == 2
        assert not demo_seeds & {int(t.rsplit(":", 1)[-1]) for t in report["tasks"]}, report[
            "tasks"
        ]

    # The control continued the SFT checkpoint's weights, for at least one more epoch.
    control = json.loads(
        (out / "sft_continued" / "checkpoints" / "step_00000000" / "state.json").read_text()
    )
    assert control["extra"]["sft"]["init_from"] == str(out / "sft")
    # its epochs are counted from the first SFT on, through `--init-from`
    cold_start = load_script()
    in_all = cold_start.epochs_in_all(cold_start.sft_record(out / "sft_continued"))
    assert in_all == summary["sft_epochs"]["sft_continued"] == 1 + control["extra"]["sft"]["epochs"]

    # Another seed from the same cold start: no new demonstrations or SFT, RL from its weights;
    # a KL penalty (whose reference is the base model) is named as pulling the SFT back.
    again = tmp_path / "cold-s1"
    said = pipeline(
        tmp_path, "--out", str(again), "--seed", "1", "--sft-from", str(out / "sft"), "--no-base",
        "--set", "algorithm.kl_coef=0.05",
    )  # fmt: skip
    assert "algorithm.kl_coef=0.05: the KL penalty's reference is the base model" in " ".join(
        said.split()
    )
    assert "$ masenvs demos" not in said and "$ masenvs sft" in said  # the control only
    summary = json.loads((again / "summary.json").read_text())
    assert set(summary["greedy_success"]) == {"sft", "rl", "sft_continued"} and summary["seed"] == 1
    for policy in ("tool", "plan"):
        assert all(
            bool((a == b).all())
            for a, b in zip(lora_b(out / "sft", 0, policy), lora_b(again / "rl", 0, policy))
        )
    assert (again / "rl" / "checkpoints" / "step_00000001").is_dir()
    # A third seed reuses the cold start's greedy eval (--sft-eval): the eval after RL only
    third = tmp_path / "cold-s2"
    said = pipeline(
        tmp_path, "--out", str(third), "--seed", "2", "--sft-from", str(out / "sft"),
        "--sft-eval", str(out / "eval_sft.json"), "--no-base", "--no-control",
    )  # fmt: skip
    assert said.count("$ masenvs eval") == 1 and "$ masenvs sft" not in said, said
    assert (third / "eval_sft.json").read_text() == (out / "eval_sft.json").read_text()
    before = json.loads((out / "eval_sft.json").read_text())["results"][0]["avg"]
    assert json.loads((third / "summary.json").read_text())["greedy_success"]["sft"] == before
    # each seed trains on its own tasks: seed S draws from S * 10000 on (one task a step here)
    for run, first in ((rl, 0), (again / "rl", 10_000)):
        state = json.loads((run / "checkpoints" / "step_00000001" / "state.json").read_text())
        assert state["next_task_seed"] == first + 1, (run, state)
