"""`masenvs sft`: supervised fine-tuning on chat traces as checkpoint 0 of a run, which
`masenvs train --resume` continues from (the cold start of MetaAgent-X), on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from masenvs.cli import main
from masenvs.trainer.sft import DataError, read_traces

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "sft" / "auto_mas_math.jsonl"
CONFIG = str(ROOT / "examples" / "auto_mas.yaml")
TINY = ["--set", "model.name=tiny"]


def adapter(run: Path, step: int, policy: str) -> dict:
    path = run / "checkpoints" / f"step_{step:08d}" / "adapters" / policy
    return load_file(str(path / "adapter_model.safetensors"))


def test_sft_lowers_the_loss_and_train_resumes_from_its_adapters(tmp_path, capsys) -> None:
    lines = EXAMPLE.read_text().splitlines()
    # Two designer and three executor conversations of the shipped example set.
    data = tmp_path / "traces.jsonl"
    data.write_text("\n".join([lines[0], lines[2], lines[1], lines[3], lines[5]]) + "\n")
    run = tmp_path / "run"
    args = [*TINY, "--set", f"run_dir={run}"]
    sft = ["sft", CONFIG, str(data), *args, "--epochs", "4", "--lr", "1e-2", "--batch-size", "4"]
    assert main(sft) == 0
    rows = [json.loads(line) for line in (run / "sft_metrics.jsonl").read_text().splitlines()]
    by_epoch = {}
    for r in rows:
        by_epoch.setdefault(r["epoch"], []).append(r["loss"] * r["tokens"])
    tokens = sum(r["tokens"] for r in rows if r["epoch"] == 1)
    losses = [sum(v) / tokens for _, v in sorted(by_epoch.items())]
    # LoRA on the random 64-wide tiny model moves its near-uniform logits only a little
    # (full fine-tuning: test_full_sft_learns_the_replies).
    assert losses[-1] < losses[0] - 0.1, losses
    state = json.loads((run / "checkpoints" / "step_00000000" / "state.json").read_text())
    assert state["step"] == 0 and state["extra"]["sft"]["epochs"] == 4
    tuned = adapter(run, 0, "executor")
    lora_b = [v for k, v in tuned.items() if "lora_B" in k]
    assert lora_b and all(float(v.abs().max()) > 1e-3 for v in lora_b)  # B starts at zero

    # sft refuses to overwrite a run
    assert main(sft) == 2 and "already holds checkpoints" in capsys.readouterr().out

    steps = [
        "--set", "steps=1", "--set", "validation.every=0", "--set", "rollout.tasks_per_step=1",
        "--set", "rollout.max_tokens=8", "--set", "env.options.max_tokens=4",
        "--set", "env.options.executions=1",
    ]  # fmt: skip
    assert main(["train", CONFIG, "--resume", *args, *steps]) == 0
    assert "resumed from" in capsys.readouterr().out
    after = adapter(run, 1, "executor")
    for key, value in tuned.items():  # one RL step at most nudges what sft wrote
        assert (after[key] - value).abs().max() < 0.1 * value.abs().max() + 1e-6, key
    # step 1 is the executor's phase (schedule.alternate): the designer keeps sft's adapter
    designer, tuned_designer = adapter(run, 1, "designer"), adapter(run, 0, "designer")
    assert any(float(v.abs().max()) > 1e-3 for k, v in designer.items() if "lora_B" in k)
    assert all(bool((designer[k] == v).all()) for k, v in tuned_designer.items())


def test_full_sft_learns_the_replies(tmp_path) -> None:
    from masenvs.trainer.config import load_config
    from masenvs.trainer.sft import sft

    data = tmp_path / "executor.jsonl"
    data.write_text("\n".join(EXAMPLE.read_text().splitlines()[1:6:2]) + "\n")
    overrides = ["model.name=tiny", f"run_dir={tmp_path / 'run'}", "policy.finetune=full"]
    cfg = load_config(CONFIG, overrides)
    result = sft(cfg, [data], epochs=4, lr=3e-3, batch_size=2, log=lambda *_: None)
    assert result.targets == 6 and result.cut == 0  # two assistant turns per conversation
    assert result.losses[-1] < result.losses[0] - 1.5, result.losses
    saved = result.checkpoint / "models"
    assert sorted(p.name for p in saved.iterdir()) == ["designer", "executor"]


def test_bad_traces_stop_with_the_file_line_and_the_fix(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    with pytest.raises(DataError, match="bad.jsonl:1 names no agent"):
        read_traces([bad])
    with pytest.raises(DataError, match="bad.jsonl:1 has no assistant turn"):
        read_traces([bad], default_agent="executor")
    bad.write_text('{"agent": "x", "conversations": [{"from": "gpt", "value": 3}]}\n')
    with pytest.raises(DataError, match="a turn needs a role"):
        read_traces([bad])
    sharegpt = tmp_path / "sharegpt.jsonl"
    sharegpt.write_text(
        json.dumps(
            {
                "conversations": [
                    {"from": "system", "value": "s"},
                    {"from": "human", "value": "q"},
                    {"from": "gpt", "value": "a"},
                ]
            }
        )
        + "\n"
    )
    (conv,) = read_traces([sharegpt], default_agent="designer")
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]
    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text(sharegpt.read_text())
    code = main(["sft", CONFIG, str(unknown), *TINY, "--set", f"run_dir={tmp_path / 'r'}",
                 "--agent", "planner"])  # fmt: skip
    assert code == 2 and "not an agent of auto_mas" in capsys.readouterr().out
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b"\xff\xfe not utf-8\n")
    with pytest.raises(DataError, match="cannot be read as UTF-8"):
        read_traces([latin])
    tiny_room = ["--max-tokens", "8", "--set", f"run_dir={tmp_path / 'r2'}"]
    assert main(["sft", CONFIG, str(EXAMPLE), *TINY, *tiny_room]) == 2
    assert "no assistant turn fits in --max-tokens 8" in capsys.readouterr().out
    missing = ["sft", CONFIG, str(tmp_path / "missing.jsonl"), *TINY, "--set", "run_dir=x"]
    assert main(missing) == 2
    assert "does not exist" in capsys.readouterr().out


def test_sft_help_does_not_load_torch() -> None:
    code = (
        "import sys\nfrom masenvs.cli import main\ntry:\n    main(['sft', '--help'])\n"
        "except SystemExit:\n    pass\nprint('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--epochs" in out.stdout and out.stdout.strip().endswith("False")
