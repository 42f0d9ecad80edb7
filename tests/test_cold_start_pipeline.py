"""scripts/cold_start_then_rl.py --smoke: solver demonstrations -> sft -> greedy eval -> AT-GRPO
from the SFT checkpoint -> eval, and the SFT-continued control, end to end on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "cold_start_then_rl.py"


def lora_b(run: Path, step: int, policy: str) -> list:
    path = run / "checkpoints" / f"step_{step:08d}" / "adapters" / policy
    tensors = load_file(str(path / "adapter_model.safetensors"))
    return [v for k, v in tensors.items() if "lora_B" in k]


def test_the_smoke_pipeline_runs_every_step_from_demos_to_rl(tmp_path: Path) -> None:
    out = tmp_path / "cold"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    said = done.stdout
    # each step as the command a user types, in order
    steps = ["$ masenvs demos", "$ masenvs sft", "$ masenvs eval", "$ masenvs train", "--resume"]
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
        assert all(float(b.abs().max()) > 0 for b in lora_b(rl, 0, policy))
    # ... and RL continued from them: step 1 of the same run, resumed from checkpoint 0
    assert "resumed from" in said and (rl / "checkpoints" / "step_00000001").is_dir()
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
