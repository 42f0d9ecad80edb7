"""`masenvs serve --adapter NAME=PATH`: a bad path or route stops before the model loads
(one line, exit 2), and every adapter is warmed before the server says it is ready, one
log line each, so no user's first call pays the engine's first-pass costs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SERVE = [sys.executable, "-m", "masenvs", "serve", "--model", "tiny", "--port", "0"]


def refused(args: list[str], cache: Path) -> str:
    """Run serve with `args` against an empty model cache; its one line of output. The
    cache stays empty: the tiny model, built there on first load, was never loaded."""
    env = {**os.environ, "MASENVS_CACHE": str(cache), "COLUMNS": "400"}
    done = subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert done.returncode == 2, lines
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert not any(cache.iterdir()), "serve loaded the model before refusing"
    return lines[0]


def adapter_dir(path: Path, config: dict | None = None, weights: bool = True) -> Path:
    """A directory shaped like peft's output; only its layout matters before loading."""
    path.mkdir(parents=True)
    if config is not None:
        (path / "adapter_config.json").write_text(json.dumps(config))
    if weights:
        (path / "adapter_model.safetensors").write_bytes(b"")
    return path


LORA = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda d: d / "nope", "does not exist"),
        (lambda d: adapter_dir(d / "a"), "no adapter_config.json"),
        (lambda d: adapter_dir(d / "a", LORA, weights=False), "no adapter weights"),
        (lambda d: adapter_dir(d / "a", {**LORA, "peft_type": "IA3"}), "holds a IA3 adapter"),
        (lambda d: adapter_dir(d / "a", {**LORA, "use_dora": True}), "DoRA"),
        (lambda d: adapter_dir(d / "a", {"peft_type": "LORA"}), "no LoRA rank"),
    ],
    ids=["missing", "no-config", "no-weights", "not-lora", "dora", "no-rank"],
)
def test_a_bad_adapter_path_stops_before_the_model_loads(tmp_path: Path, make, expected) -> None:
    (cache := tmp_path / "cache").mkdir()
    path = make(tmp_path)
    line = refused(["--adapter", f"tool={path}"], cache)
    assert line.startswith(f"masenvs serve: --adapter tool={path}: "), line
    assert expected in line, line


def test_a_route_to_an_adapter_not_loaded_stops_before_the_model_loads(tmp_path: Path) -> None:
    (cache := tmp_path / "cache").mkdir()
    tool = adapter_dir(tmp_path / "tool", LORA)
    line = refused(["--adapter", f"tool={tool}", "--route", "solver=solver_lora"], cache)
    assert "--route solver=solver_lora" in line and "base, tool" in line, line
    assert "--adapter solver_lora=PATH" in line, line


def make_adapter(directory: Path) -> Path:
    """A real peft LoRA adapter for the tiny model."""
    from peft import LoraConfig, get_peft_model

    from masenvs.engine.loading import load_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    get_peft_model(load_model("tiny").model, config).save_pretrained(directory)
    return directory


def test_serve_warms_every_adapter_before_it_says_ready(tmp_path: Path) -> None:
    import openai

    tool, plan = make_adapter(tmp_path / "tool"), make_adapter(tmp_path / "plan")
    args = [*SERVE, "--adapter", f"tool={tool}", "--adapter", f"plan={plan}"]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if " at http://" in line:
                break
        log = "".join(lines)
        # One line per model it warmed, with its time, all before the ready banner.
        warmed = re.findall(r"masenvs serve: warmed (base|adapter \w+) in \d+\.\d s", log)
        assert warmed == ["base", "adapter tool", "adapter plan"], log
        url = lines[-1].split(" at ")[-1].strip()
        reply = openai.OpenAI(base_url=url, api_key="unused").chat.completions.create(
            model="plan", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert reply.model == "plan" and reply.choices[0].message.content is not None
    finally:
        server.terminate()
        server.wait(timeout=60)
